"""ShardedOptimizer on 2 gloo ranks (CPU), against unsharded training in one process.

Each ``check_*`` function runs on every rank (``run_in_turn`` runs them one after another in
one process group of 2 spawned ranks, each from the same state) and asserts there:
every rank builds the same seeded model, computes the unsharded reference itself (a plain
optimizer on the whole batch), then trains the sharded way on its half of each batch with
averaged gradients, and compares. Related checks share one spawn: each costs seconds of start-up.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from sharded_optim_helpers import (
    ATOL,
    OPTIMIZERS,
    assert_same_parameters,
    make_model,
    param_groups,
    train,
)
from torch import nn

from llmsys.sharded_optim import ShardedOptimizer, resync
from llmsys_dev.ranks import run_in_turn

STEPS = 4
TIMEOUT = 120
DEFAULT_BUCKET_BYTES = resync.BUCKET_BYTES
TRAINED = 5  # parameters of TinyLM that get gradients: embedding (= head), hidden x 2, out x 2


def assert_identical_on_every_rank(model: nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(other, flat) for other in gathered), "ranks' parameters differ"


def assert_state_sharded(optimizer: ShardedOptimizer, rank: int) -> None:
    """Each rank holds state only for parameters it owns; all ranks together, once for each
    parameter that had a gradient."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owned = {id(params[i]) for i in optimizer.ownership.params_of(rank)}
    held = [p for p, state in optimizer.state.items() if state]
    assert all(id(p) in owned for p in held)
    counts = [0] * dist.get_world_size()
    dist.all_gather_object(counts, len(held))
    assert sum(counts) == TRAINED, counts


def tiny_lm_matches_unsharded(rank: int, world_size: int) -> None:
    # The default cap packs each owner's tensors into one buffer; 0 sends every tensor in
    # place; 200 bytes mixes both (the float64 embedding, 528 bytes, goes alone).
    for bucket_bytes in (DEFAULT_BUCKET_BYTES, 0, 200):
        resync.BUCKET_BYTES = bucket_bytes
        for name, (optimizer_cls, kwargs) in OPTIMIZERS.items():
            reference = make_model()
            train(reference, optimizer_cls(param_groups(reference), **kwargs), STEPS)
            model = make_model()
            groups = param_groups(model, tied_twice=True)
            optimizer = ShardedOptimizer(groups, optimizer_cls, **kwargs)
            train(model, optimizer, STEPS, rank=rank, world_size=world_size)
            assert_same_parameters(model, reference)
            assert_identical_on_every_rank(model)
            assert_state_sharded(optimizer, rank)
            assert all(optimizer.ownership.loads), f"{name}: a rank owns nothing"


def odd_layouts_match_unsharded(rank: int, world_size: int) -> None:
    # Mixed dtypes and a non-contiguous parameter, with every bucket path.
    def make_params():
        torch.manual_seed(0)
        return [
            nn.Parameter(torch.randn(4, 3, dtype=torch.float64)),
            nn.Parameter(torch.randn(5, 3, dtype=torch.float64).t()),  # (3, 5), not contiguous
            nn.Parameter(torch.randn(5)),  # float32
        ]

    def backward(params, rank, world_size, step):
        a, b, c = params
        x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        x = x[rank * 8 // world_size : (rank + 1) * 8 // world_size]
        (torch.tanh(x @ a @ b) * c.double()).pow(2).mean().backward()
        for p in params:
            if world_size > 1:
                dist.all_reduce(p.grad)
                p.grad /= world_size

    for bucket_bytes in (DEFAULT_BUCKET_BYTES, 0):
        resync.BUCKET_BYTES = bucket_bytes
        for optimizer_cls, kwargs in OPTIMIZERS.values():
            reference, params = make_params(), make_params()
            plain = optimizer_cls(reference, **kwargs)
            optimizer = ShardedOptimizer(params, optimizer_cls, **kwargs)
            assert not params[1].is_contiguous()
            for step in range(STEPS):
                for ps, opt, ranks in ((reference, plain, (0, 1)), (params, optimizer, (rank, 2))):
                    opt.zero_grad()
                    backward(ps, *ranks, step)
                    opt.step()
            for p, q in zip(params, reference, strict=True):
                atol = ATOL if p.dtype == torch.float64 else 1e-6
                torch.testing.assert_close(p, q, rtol=0, atol=atol)

    # One parameter on two ranks: rank 1 owns nothing, its local optimizer is empty.
    weight = nn.Parameter(torch.arange(6.0))
    optimizer = ShardedOptimizer([weight], torch.optim.SGD, lr=0.5)
    assert optimizer.ownership.owners == (0,)
    weight.grad = torch.ones(6)
    optimizer.step()
    assert torch.equal(weight.detach(), torch.arange(6.0) - 0.5)
    assert (len(optimizer.local_optimizer.param_groups[0]["params"]) == 0) == (rank == 1)

    # Ranks with different parameters: an error on every rank instead of a hang.
    mismatched = nn.Parameter(torch.zeros(3 + rank))
    with pytest.raises(ValueError, match=r"every rank must pass the same parameters"):
        ShardedOptimizer([mismatched], torch.optim.SGD, lr=0.1)


def check_training_matches_unsharded(rank: int, world_size: int) -> None:
    try:
        tiny_lm_matches_unsharded(rank, world_size)
        odd_layouts_match_unsharded(rank, world_size)
    finally:  # the checks after this one in the process group run with the default cap
        resync.BUCKET_BYTES = DEFAULT_BUCKET_BYTES


def single_process_checkpoint(folder: Path) -> Path:
    """A ShardedOptimizer's checkpoint (with its model) after 3 steps in one process without a
    process group, for ``check_checkpoints_across_world_sizes``."""
    optimizer_cls, kwargs = OPTIMIZERS["adamw"]
    model = make_model()
    optimizer = ShardedOptimizer(param_groups(model), optimizer_cls, **kwargs)
    train(model, optimizer, 3)
    optimizer.consolidate_state_dict()
    checkpoint = folder / "one-process.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    return checkpoint


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """This module's 2-rank checks, in turn in one process group (one spawn instead of 4)."""
    scratch = tmp_path_factory.mktemp("checkpoints")
    checkpoints = {"single_process_checkpoint": str(single_process_checkpoint(scratch)),
                   "scratch": str(scratch)}  # fmt: skip
    checks = {
        "training": (check_training_matches_unsharded, {}),
        "scheduler": (check_scheduler_clipping_and_new_group, {}),
        "checkpoints": (check_checkpoints_across_world_sizes, checkpoints),
        "one rank failing": (check_one_rank_failing_does_not_hang, {}),
        "differing parameters": (check_parameters_that_differ_between_ranks_are_refused, {}),
    }
    return run_in_turn(checks, world_size=2, timeout=4 * TIMEOUT)


def test_training_matches_unsharded(two_ranks):
    """AdamW and SGD with momentum, every bucket path: a model with frozen, tied and
    gradient-less parameters in two groups with their own learning rates; mixed dtypes and a
    non-contiguous parameter; a rank that owns nothing; ranks with different parameters."""
    two_ranks.check("training")


def check_scheduler_clipping_and_new_group(rank: int, world_size: int) -> None:
    optimizer_cls, kwargs = OPTIMIZERS["adamw"]
    max_norm = 0.05

    # An LR scheduler and gradient clipping by the global norm.
    reference = make_model()
    plain = optimizer_cls(param_groups(reference), **kwargs)
    expected_norms = train(
        reference,
        plain,
        STEPS,
        clip=lambda: torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm),
        scheduler=torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5),
    )
    model = make_model()
    optimizer = ShardedOptimizer(param_groups(model), optimizer_cls, **kwargs)
    norms = train(
        model,
        optimizer,
        STEPS,
        rank=rank,
        world_size=world_size,
        clip=lambda: optimizer.clip_grad_norm_(max_norm),
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
    )
    assert all(norm > max_norm for norm in expected_norms)  # every step clipped
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected_norms), rtol=0, atol=ATOL)
    # the scheduler halved the lr after each step; the local optimizer took it at each step
    assert [g["lr"] for g in optimizer.param_groups] == [0.02 / 16, 0.005 / 16]
    assert [g["lr"] for g in optimizer.local_optimizer.param_groups] == [0.02 / 8, 0.005 / 8]
    assert_same_parameters(model, reference)

    # add_param_group after two steps: a frozen layer is unfrozen and trained from then on.
    reference, model = make_model(), make_model()
    plain = optimizer_cls(param_groups(reference)[:1], **kwargs)
    optimizer = ShardedOptimizer(param_groups(model)[:1], optimizer_cls, **kwargs)
    for m, opt, ranks in ((reference, plain, (0, 1)), (model, optimizer, (rank, world_size))):
        m.out.requires_grad_(False)
        train(m, opt, 2, rank=ranks[0], world_size=ranks[1])
        m.out.requires_grad_(True)
        opt.add_param_group({"params": list(m.out.parameters()), "lr": 0.03})
        train(m, opt, 2, start=2, rank=ranks[0], world_size=ranks[1])
    assert len(optimizer.ownership.owners) == 5 and set(optimizer.ownership.owners[3:]) == {0, 1}
    assert_same_parameters(model, reference)
    assert_identical_on_every_rank(model)


def test_scheduler_clipping_and_add_param_group(two_ranks):
    two_ranks.check("scheduler")


def check_checkpoints_across_world_sizes(
    rank: int, world_size: int, single_process_checkpoint: str, scratch: str
) -> None:
    optimizer_cls, kwargs = OPTIMIZERS["adamw"]
    reference = make_model()
    plain = optimizer_cls(param_groups(reference), **kwargs)
    train(reference, plain, 3)
    model = make_model()
    optimizer = ShardedOptimizer(param_groups(model), optimizer_cls, **kwargs)
    train(model, optimizer, 3, rank=rank, world_size=world_size)

    # The full state dict, gathered on rank 1, is the unsharded optimizer's.
    optimizer.consolidate_state_dict(to=1)
    if rank == 1:
        full = optimizer.state_dict()
        expected = plain.state_dict()
        assert full["param_groups"] == expected["param_groups"]
        assert full["state"].keys() == expected["state"].keys()
        for i, state in expected["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(full["state"][i][key], value, rtol=0, atol=ATOL)
        torch.save(full, f"{scratch}/full.pt")
    else:
        with pytest.raises(RuntimeError, match="gathered on another rank"):
            optimizer.state_dict()
    dist.barrier()
    full = torch.load(f"{scratch}/full.pt")

    # 2 ranks -> a plain optimizer in one process, and -> 2 ranks again: the same next step.
    single = copy.deepcopy(model)
    single_optimizer = optimizer_cls(param_groups(single), **kwargs)
    single_optimizer.load_state_dict(copy.deepcopy(full))
    again = copy.deepcopy(model)
    again_optimizer = ShardedOptimizer(param_groups(again), optimizer_cls, **kwargs)
    again_optimizer.load_state_dict(copy.deepcopy(full))
    train(single, single_optimizer, 1, start=3)
    train(model, optimizer, 1, start=3, rank=rank, world_size=world_size)
    train(again, again_optimizer, 1, start=3, rank=rank, world_size=world_size)
    assert_same_parameters(model, single)
    assert_same_parameters(again, model, atol=0)

    # 1 -> 2 ranks: a ShardedOptimizer's checkpoint from one process without a process group.
    saved = torch.load(single_process_checkpoint)
    continued, sharded = make_model(), make_model()
    continued.load_state_dict(saved["model"])
    sharded.load_state_dict(saved["model"])
    continued_optimizer = optimizer_cls(param_groups(continued), **kwargs)
    continued_optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
    sharded_optimizer = ShardedOptimizer(param_groups(sharded), optimizer_cls, **kwargs)
    sharded_optimizer.load_state_dict(saved["optimizer"])
    assert_state_sharded(sharded_optimizer, rank)
    train(continued, continued_optimizer, 2, start=3)
    train(sharded, sharded_optimizer, 2, start=3, rank=rank, world_size=world_size)
    assert_same_parameters(sharded, continued)

    # Ranks that load different dicts: an error on every rank, never a silent divergence.
    partial = copy.deepcopy(full)
    del partial["state"][max(partial["state"])]
    with pytest.raises(RuntimeError, match=r"exactly once, on its owner"):
        optimizer.load_state_dict(full if rank == 0 else partial)


def test_checkpoints_across_world_sizes(two_ranks):
    """2 ranks -> 1 (plain AdamW), 2 -> 2, and 1 (no process group) -> 2."""
    two_ranks.check("checkpoints")


def check_one_rank_failing_does_not_hang(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 40)
    optimizer = ShardedOptimizer([*embed.parameters(), *head.parameters()], torch.optim.AdamW)
    head(embed(torch.tensor([1, 2]))).sum().backward()
    if (
        rank == optimizer.ownership.owners[0]
    ):  # the embedding's owner: Adam refuses sparse gradients
        with pytest.raises(RuntimeError, match="sparse"):
            optimizer.step()
    else:  # the other rank's broadcasts are answered: it returns instead of hanging
        optimizer.step()
    assert len(set(optimizer.ownership.owners)) == 2  # the failure is on one rank only


def test_a_step_failing_on_one_rank_does_not_hang_the_others(two_ranks):
    two_ranks.check("one rank failing")


def check_parameters_that_differ_between_ranks_are_refused(rank: int, world_size: int) -> None:
    # Each rank's own values under the same shapes, as FSDP's slices are: an owner's broadcast
    # would overwrite the other ranks' different slices.
    torch.manual_seed(rank)
    layer = nn.Linear(4, 6)
    before = [p.detach().clone() for p in layer.parameters()]
    with pytest.raises(ValueError, match=r"replicas of the same parameters .* 2 that differ .*"
                                         r"global index 0 \(shape \(6, 4\)\).*\(FSDP"):  # fmt: skip
        ShardedOptimizer(layer.parameters(), torch.optim.SGD, lr=0.1)
    assert all(torch.equal(p, q) for p, q in zip(layer.parameters(), before, strict=True))


def test_parameters_that_differ_between_ranks_are_refused(two_ranks):
    two_ranks.check("differing parameters")


def check_on_gpus_with_nccl(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    optimizer_cls, kwargs = OPTIMIZERS["adamw"]
    reference = make_model().to(device)
    train(reference, optimizer_cls(param_groups(reference), **kwargs), STEPS)
    model = make_model().to(device)
    optimizer = ShardedOptimizer(param_groups(model), optimizer_cls, fused=True, **kwargs)
    train(model, optimizer, STEPS, rank=rank, world_size=world_size)
    assert_same_parameters(model, reference, atol=1e-9)  # fused vs for-each AdamW kernels
    optimizer.consolidate_state_dict(to=0)  # NCCL point to point, state to CPU
    full = [optimizer.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(full, src=0)
    again = ShardedOptimizer(param_groups(make_model().to(device)), optimizer_cls, **kwargs)
    again.load_state_dict(full[0])
    assert_state_sharded(again, rank)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_on_gpus_with_nccl(run_ranks):
    run_ranks(check_on_gpus_with_nccl, world_size=2, timeout=TIMEOUT, backend="nccl")
