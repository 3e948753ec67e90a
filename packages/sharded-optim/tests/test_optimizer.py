"""ShardedOptimizer in one process, without torch.distributed (a world of one rank): the same
results as the plain optimizer, bit for bit, and a clear error for each kind of bad use."""

import copy
import warnings

import pytest
import torch
from sharded_optim_helpers import OPTIMIZERS, backward, make_model, param_groups, train

from llmsys.sharded_optim import ShardedOptimizer

STEPS = 4


@pytest.fixture
def model():
    return make_model()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_world_size_one_equals_the_plain_optimizer_exactly(name):
    optimizer_cls, kwargs = OPTIMIZERS[name]
    sharded_model, plain_model = make_model(), make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no duplicate-parameter warning for the tied weight
        sharded = ShardedOptimizer(
            param_groups(sharded_model, tied_twice=True), optimizer_cls, **kwargs
        )
    plain = optimizer_cls(param_groups(plain_model), **kwargs)
    train(sharded_model, sharded, STEPS)
    train(plain_model, plain, STEPS)
    assert (sharded.rank, sharded.world_size) == (0, 1)
    for p, q in zip(sharded_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_groups_are_complete_and_the_tied_weight_counts_once(model):
    optimizer = ShardedOptimizer(param_groups(model, tied_twice=True), torch.optim.AdamW, lr=0.01)
    plain = torch.optim.AdamW(param_groups(make_model()), lr=0.01)
    assert [len(g["params"]) for g in optimizer.param_groups] == [3, 5]
    assert optimizer.ownership.owners == (0,) * 8
    # every option the plain optimizer has, with the groups' own values
    for group, plain_group in zip(optimizer.param_groups, plain.param_groups, strict=True):
        assert group.keys() == plain_group.keys()
        assert {k: v for k, v in group.items() if k != "params"} == {
            k: v for k, v in plain_group.items() if k != "params"
        }


def test_state_only_for_parameters_that_had_gradients(model):
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=0.01)
    train(model, optimizer, 1)
    with_state = {id(p) for p, state in optimizer.state.items() if state}
    trained = [model.embedding.weight, *model.hidden.parameters(), *model.out.parameters()]
    assert with_state == {id(p) for p in trained}  # not the frozen layer, not `unused`
    assert optimizer.state is optimizer.local_optimizer.state


def test_a_scheduler_sets_the_local_learning_rate(model):
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.SGD, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    plain_model = make_model()
    plain = torch.optim.SGD(param_groups(plain_model), lr=0.1)
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    train(model, optimizer, 3, scheduler=scheduler)
    train(plain_model, plain, 3, scheduler=plain_scheduler)
    # halved after each step; the local optimizer takes the lr at the start of each step
    assert [g["lr"] for g in optimizer.param_groups] == [0.02 / 8, 0.005 / 8]
    assert [g["lr"] for g in optimizer.local_optimizer.param_groups] == [0.02 / 4, 0.005 / 4]
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_add_param_group_during_training(model):
    plain_model = make_model()
    optimizer = ShardedOptimizer(param_groups(model)[:1], torch.optim.AdamW, lr=0.01)
    plain = torch.optim.AdamW(param_groups(plain_model)[:1], lr=0.01)
    for m, opt in ((model, optimizer), (plain_model, plain)):
        m.out.requires_grad_(False)  # fine-tuning: a layer is unfrozen after two steps
        train(m, opt, 2)
        m.out.requires_grad_(True)
        opt.add_param_group({"params": list(m.out.parameters()), "lr": 0.03})
        train(m, opt, 2, start=2)
    assert optimizer.ownership.owners == (0,) * 5
    assert optimizer.param_groups[1].keys() == plain.param_groups[1].keys()
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_clip_grad_norm_equals_torch(model):
    plain_model = make_model()
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.SGD, lr=0.1)
    plain = torch.optim.SGD(param_groups(plain_model), lr=0.1)
    norms = train(model, optimizer, 3, clip=lambda: optimizer.clip_grad_norm_(0.1))
    expected = train(
        plain_model,
        plain,
        3,
        clip=lambda: torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.1),
    )
    assert all(norm > 0.1 for norm in expected)  # it did clip
    assert torch.equal(torch.stack(norms), torch.stack(expected))
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_round_trip_in_one_process(model):
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=0.01)
    train(model, optimizer, 2)
    optimizer.consolidate_state_dict()
    state_dict = optimizer.state_dict()
    plain_model = copy.deepcopy(model)
    plain = torch.optim.AdamW(param_groups(plain_model), lr=0.01)
    plain.load_state_dict(copy.deepcopy(state_dict))
    reloaded_model = copy.deepcopy(model)
    reloaded = ShardedOptimizer(param_groups(reloaded_model), torch.optim.AdamW, lr=0.01)
    reloaded.load_state_dict(copy.deepcopy(state_dict))
    assert plain.state_dict()["param_groups"] == state_dict["param_groups"]
    for m, opt in ((model, optimizer), (plain_model, plain), (reloaded_model, reloaded)):
        train(m, opt, 1, start=2)
    for other in (plain_model, reloaded_model):
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert torch.equal(p, q)


def test_the_consolidated_state_is_a_snapshot_until_the_next_step(model):
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=0.01)
    train(model, optimizer, 1)
    optimizer.consolidate_state_dict()
    saved = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    train(model, optimizer, 1, start=1)
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=rank\) on every rank"):
        optimizer.state_dict()
    optimizer.consolidate_state_dict()
    assert not torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved)


# ---- bad use: a clear error naming the argument --------------------------------------------


def test_state_dict_without_consolidation_raises(model):
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    with pytest.raises(RuntimeError, match=r"holds only its own shard.*consolidate_state_dict"):
        optimizer.state_dict()


@pytest.mark.parametrize(
    "optimizer_cls", ["adamw", torch.nn.Linear, ShardedOptimizer, None], ids=str
)
def test_optimizer_cls_must_be_an_optimizer_class(model, optimizer_cls):
    with pytest.raises(
        TypeError, match=r"`optimizer_cls` (must be a torch.optim.Optimizer|cannot)"
    ):
        ShardedOptimizer(model.parameters(), optimizer_cls)


def test_optimizer_cls_must_be_the_class_not_an_instance(model):
    instance = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"`optimizer_cls` must be .*got SGD \("):
        ShardedOptimizer(model.parameters(), instance)


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (
            torch.ones(2, requires_grad=True),
            TypeError,
            r"`params` must be an iterable .* got Tensor",
        ),
        (3, TypeError, r"`params` must be an iterable .* got int"),
        ([], ValueError, r"`params` must hold at least one parameter"),
        ([torch.ones(2), {"params": []}], TypeError, r"`params` must hold either tensors or dicts"),
        ([torch.ones(2), "w"], TypeError, r"`params` must hold tensors, got str at position 1"),
        ([torch.ones(2, requires_grad=True) * 2], ValueError, r"leaf tensors .* at position 0"),
        ([{"params": {torch.ones(2)}}], TypeError, r"`params` must be a tensor or an ordered"),
        ([{"lr": 0.1}], TypeError, r"`param_group` must be a dict with a 'params' entry"),
        ({torch.ones(2)}, TypeError, r"`params` must be an ordered iterable .* got a set"),
        (frozenset({torch.ones(2)}), TypeError, r"`params` must be an ordered .* frozenset"),
        ({"params": [torch.ones(2)]}, TypeError, r"`params` must be an iterable .* got dict"),
    ],
    ids=[
        "tensor", "int", "empty", "mixed", "not-a-tensor", "non-leaf", "group-set", "no-params",
        "set", "frozenset", "one-group-dict",
    ],
)  # fmt: skip
def test_bad_params(params, error, message):
    with pytest.raises(error, match=message):
        ShardedOptimizer(params, torch.optim.SGD, lr=0.1)


def test_a_parameter_in_two_groups_is_an_error(model):
    groups = [
        {"params": [model.hidden.weight]},
        {"params": [model.out.weight, model.hidden.weight]},
    ]
    with pytest.raises(ValueError, match=r"one param group only; `params` position 1 .* group 0"):
        ShardedOptimizer(groups, torch.optim.SGD, lr=0.1)
    optimizer = ShardedOptimizer(model.hidden.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"add_param_group: a parameter can be in one param group"):
        optimizer.add_param_group({"params": [model.out.weight, model.hidden.bias]})
    with pytest.raises(TypeError, match=r"add_param_group: `param_group` must be a dict"):
        optimizer.add_param_group([model.out.weight])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_norm": -1.0}, ValueError, r"`max_norm` must be a non-negative number, got -1.0"),
        ({"max_norm": float("nan")}, ValueError, r"`max_norm` must be a non-negative .* nan"),
        ({"max_norm": "1"}, TypeError, r"`max_norm` must be a number, got str"),
        ({"max_norm": None}, TypeError, r"`max_norm` must be a number, got NoneType"),
        ({"max_norm": True}, TypeError, r"`max_norm` must be a number, got bool"),
        ({"max_norm": 1.0, "norm_type": float("nan")}, ValueError, r"`norm_type` must be a"),
        ({"max_norm": 1.0, "norm_type": 0}, ValueError, r"`norm_type` must be a positive"),
        ({"max_norm": 1.0, "norm_type": "2"}, TypeError, r"`norm_type` must be a number"),
    ],
)
def test_clip_grad_norm_refuses_bad_arguments_before_touching_gradients(
    model, kwargs, error, message
):
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    backward(model, step=0)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with pytest.raises(error, match=message):
        optimizer.clip_grad_norm_(**kwargs)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(g, h) for g, h in zip(grads, after, strict=True))


def test_clip_grad_norm_with_inf_max_norm_only_measures(model):
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    backward(model, step=0)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = optimizer.clip_grad_norm_(float("inf"))
    assert norm.isfinite()
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(g, h) for g, h in zip(grads, after, strict=True))


@pytest.mark.parametrize("to", [1, -1, 0.0])
def test_consolidate_to_must_be_a_rank(model, to):
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"`to` must be a rank in 0..0, got"):
        optimizer.consolidate_state_dict(to=to)


def full_state_dict(model):
    optimizer = ShardedOptimizer(param_groups(model), torch.optim.AdamW, lr=0.01)
    train(model, optimizer, 1)
    optimizer.consolidate_state_dict()
    return optimizer, optimizer.state_dict()


def test_load_state_dict_rejects_what_does_not_fit(model):
    optimizer, good = full_state_dict(model)
    one_group = {"state": {}, "param_groups": [{"params": list(range(8))}]}
    cases = [
        ([1, 2], TypeError, r"`state_dict` must be a full optimizer state dict.* got list"),
        ({"state": {}}, TypeError, r"mapping with 'state' and 'param_groups' .* got \['state'\]"),
        (
            one_group,
            ValueError,
            r"groups of the sizes this optimizer has, \[3, 5\] parameters, got \[8\]",
        ),
        ({**good, "state": {**good["state"], 99: {}}}, ValueError, r"parameter ids \[99\] that no"),
    ]
    duplicate = copy.deepcopy(good)
    duplicate["param_groups"][1]["params"][0] = 0
    cases.append((duplicate, ValueError, r"lists a parameter id twice"))
    for state_dict, error, message in cases:
        with pytest.raises(error, match=message):
            optimizer.load_state_dict(state_dict)


def test_load_state_dict_from_a_plain_optimizer_with_other_ids(model):
    """Ids are matched by position, as torch does: any distinct ids work."""
    optimizer, good = full_state_dict(model)
    renamed = {
        "state": {10 + i: state for i, state in good["state"].items()},
        "param_groups": [
            {**g, "params": [10 + i for i in g["params"]]} for g in good["param_groups"]
        ],
    }
    optimizer.load_state_dict(renamed)
    optimizer.consolidate_state_dict()
    for i, state in optimizer.state_dict()["state"].items():
        assert torch.equal(state["exp_avg"], good["state"][i]["exp_avg"])
