"""FSDP against single-process training on the whole batch (2 or 3 gloo ranks, or none).

Each rank function runs in its own process (the ``run_ranks`` fixture) and trains the
single-process reference itself, so comparisons need no communication.
"""

from __future__ import annotations

import functools
import gc
import itertools
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from llmsys.ddp import FSDP
from llmsys_dev.ranks import run_in_turn

BATCH, STEPS = 12, 3  # a batch of 12 splits evenly over 1, 2 or 3 ranks


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))  # 1-D: replicated

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class OwnLinear(nn.Module):
    """A user's layer: a raw 2-D parameter used by a matmul, and a bias (replicated)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class TiedLM(nn.Module):
    """Embedding shared with the output head, a norm gain, a user layer, a layer never used."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.mix = OwnLinear(8, 9)
        self.back = nn.Linear(9, 8)
        self.norm = RMSNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight
        self.never = nn.Linear(8, 8)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.back(torch.tanh(self.mix(h)))
        return self.head(self.norm(h))


class FrozenCheckpointed(nn.Module):
    """A frozen layer, a buffer (not cast for compute: buffers keep their dtype), and layers
    under reentrant and non-reentrant checkpointing."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.reentrant = nn.Linear(16, 16)
        self.non_reentrant = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.last = nn.Linear(16, 3)
        self.register_buffer("scale", torch.rand(16))

    def forward(self, x):
        h = torch.tanh(self.frozen(torch.tanh(self.first(x)) * self.scale.to(x.dtype)))
        h = checkpoint(lambda t: torch.tanh(self.reentrant(t)), h, use_reentrant=True)
        h = checkpoint(self.non_reentrant, h, use_reentrant=False)
        return self.last(h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(8)
        self.up = nn.Linear(8, 16)
        self.gate = OwnLinear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, h):
        x = self.norm(h)
        return h + self.down(torch.tanh(self.up(x)) * self.gate(x))


class BlocksLM(nn.Module):
    """Blocks in an ``nn.ModuleList`` (each gathered in one collective): one plain, one under
    non-reentrant checkpointing, one under reentrant checkpointing."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 11, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.blocks[0](h)
        h = checkpoint(self.blocks[1], h, use_reentrant=False)
        h = checkpoint(self.blocks[2], h, use_reentrant=True)
        return self.head(h)


class HeadReadOutside(BlocksLM):
    """The output layer's weight read in the model's forward, not the layer's, as a fused loss
    reads it (``linear_cross_entropy(h, lm_head.weight, ...)``)."""

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return h @ self.head.weight.T


def regression_batch(generator):
    return torch.randn(BATCH, 6, generator=generator), torch.randn(BATCH, 3, generator=generator)


def token_batch(generator):
    tokens = torch.randint(0, 11, (BATCH, 5), generator=generator)
    return tokens, torch.randint(0, 11, (BATCH, 5), generator=generator)


def at_least_float32(tensor):  # a loss in half precision would round more than the test allows
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def token_loss(logits, targets):
    return F.cross_entropy(at_least_float32(logits).flatten(0, 1), targets.flatten())


def regression_loss(out, targets):
    return F.mse_loss(at_least_float32(out), targets)


MODELS = {  # name: (constructor, batch maker, loss)
    "tied": (TiedLM, token_batch, token_loss),
    "frozen, checkpointed": (FrozenCheckpointed, regression_batch, regression_loss),
    "blocks": (BlocksLM, token_batch, token_loss),
    "head read outside its forward": (HeadReadOutside, token_batch, token_loss),
}


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    # Adam divides by the gradient's size, so rounding in a near-zero gradient can flip an
    # update's sign: half-precision comparisons take plain steps, whose error stays lr * error.
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
}


def batches(kind, steps=STEPS):
    generator = torch.Generator().manual_seed(1234)
    return [MODELS[kind][1](generator) for _ in range(steps)]


class Cast(nn.Module):
    """A parametrization: the weight in ``dtype`` for forward and backward; the original stays
    the master weight and its gradient comes back in the original's dtype."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, weight):
        return weight.to(self.dtype)


def cast_floating_inputs(module, args, kwargs, dtype):
    def cast(value):
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    return tree_map(cast, (args, kwargs))


def mixed_precision(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The mixed-precision policy of ``FSDP(compute_dtype=dtype)`` applied to a plain model, in
    place: each module holding a parameter of two or more dimensions (``nn.Linear``,
    ``nn.Embedding``, ``OwnLinear``) sees its floating parameters in ``dtype`` (through torch's
    parametrizations: the originals stay the master weights and get their gradients in their
    own dtype) and its floating inputs cast to ``dtype``; every other module (a norm) keeps its
    parameters as they are."""
    for module in list(model.modules()):
        own = dict(module.named_parameters(recurse=False))
        if not any(p.dim() >= 2 for p in own.values()):
            continue
        for name, param in own.items():
            if param.is_floating_point():
                parametrize.register_parametrization(module, name, Cast(dtype), unsafe=True)
        module.register_forward_pre_hook(
            functools.partial(cast_floating_inputs, dtype=dtype), with_kwargs=True
        )
    return model


def train_single_process(kind, compute_dtype=None, steps=STEPS, optimizer="adamw", device="cpu"):
    """The reference: the whole batch in one process; with ``compute_dtype``, under the
    ``mixed_precision`` policy (float master weights take the step)."""
    torch.manual_seed(0)
    make, _, loss_fn = MODELS[kind]
    model = make().to(device)
    if compute_dtype is not None:
        mixed_precision(model, compute_dtype)
    optimizer = OPTIMIZERS[optimizer](model.parameters())
    for inputs, targets in batches(kind, steps):
        optimizer.zero_grad()
        loss_fn(model(inputs.to(device)), targets.to(device)).backward()
        optimizer.step()
    return model


def master_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters under their plain names (a parametrized weight's original)."""
    return {
        name.replace("parametrizations.", "").replace(".original", ""): p
        for name, p in model.named_parameters()
    }


def train_fsdp(
    kind,
    rank,
    world_size,
    compute_dtype=None,
    steps=STEPS,
    optimizer="adamw",
    device="cpu",
    blocks_per_gather=1,
):
    torch.manual_seed(rank)  # each rank initializes differently: rank 0's weights must win
    make, _, loss_fn = MODELS[kind]
    model = FSDP(make().to(device), compute_dtype, blocks_per_gather=blocks_per_gather)
    optimizer = OPTIMIZERS[optimizer](model.parameters())
    mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    for inputs, targets in batches(kind, steps):
        optimizer.zero_grad()
        loss_fn(model(inputs[mine].to(device)), targets[mine].to(device)).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    return model, optimizer


def assert_matches(expected: nn.Module, got: dict, label: str, atol: float) -> None:
    want = master_weights(expected)
    assert got.keys() == want.keys(), label
    for name, value in want.items():
        assert got[name].shape == value.shape, (label, name)
        error = (got[name] - value.detach()).abs().max().item()
        assert error <= atol, f"{label}: {name} differs from single-process training by {error}"


def check_training(rank, world_size, kind, checkpoint_path=None):
    torch.set_default_dtype(torch.float64)
    expected = train_single_process(kind)
    model, optimizer = train_fsdp(kind, rank, world_size)
    assert_matches(expected, model.gather_full_params(), kind, atol=1e-12)

    # Every 2-D parameter is this rank's flat slice, and so is its gradient and AdamW state.
    for name, param in model.module.named_parameters():
        full = dict(expected.named_parameters())[name]
        if full.dim() == 2:
            assert param.shape == (-(-full.numel() // world_size),), name
            if param.requires_grad and name != "never.weight":
                assert param.grad.shape == param.shape, name
                assert optimizer.state[param]["exp_avg"].shape == param.shape, name
        else:
            assert param.shape == full.shape, name
    # No full weight is left behind, even where checkpointing stopped a recomputation early.
    for module in model.module.modules():
        for name, param in module.named_parameters(recurse=False):
            assert getattr(module, name) is param, (type(module).__name__, name)
    never = getattr(model.module, "never", None)
    if never is not None:  # never used on any rank: no gradient, as in single-process training
        assert never.weight.grad is None and never.bias.grad is None

    # The full state dict loads into a plain model, and back into the sharded one.
    plain = MODELS[kind][0]()
    plain.load_state_dict(model.state_dict())
    assert_matches(expected, dict(plain.named_parameters()), f"{kind} state_dict", atol=1e-12)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    model.load_state_dict(plain.state_dict())
    assert_matches(plain, model.gather_full_params(), f"{kind} load_state_dict", atol=0.0)

    if checkpoint_path is not None:  # saved by another world size
        model.load_state_dict(torch.load(checkpoint_path))
        assert_matches(expected, model.gather_full_params(), "checkpoint", atol=1e-12)
    if kind == "tied":
        check_clip_grad_norm(rank, world_size)


@pytest.fixture(scope="module")
def two_ranks():
    """This module's 2-rank checks, in turn in one process group (one spawn instead of 4)."""
    checks = {kind: (check_training, {"kind": kind}) for kind in MODELS}
    checks["float32"] = (check_float32_bit_for_bit, {})
    checks["compute dtypes"] = (check_compute_dtypes, {})
    checks["issue 48 mixed precision"] = (check_issue_48_mixed_precision, {})
    checks["two blocks per gather"] = (check_two_blocks_per_gather, {})
    return run_in_turn(checks, world_size=2, timeout=400)


@pytest.mark.parametrize("kind", list(MODELS))
def test_matches_single_process_training(two_ranks, kind):
    two_ranks.check(kind)


def test_three_ranks_pad_uneven_slices_and_load_a_one_rank_checkpoint(run_ranks, tmp_path):
    torch.set_default_dtype(torch.float64)
    try:
        model, _ = train_fsdp("tied", rank=0, world_size=1)
        torch.save(model.state_dict(), tmp_path / "full.pt")
    finally:
        torch.set_default_dtype(torch.float32)
    path = str(tmp_path / "full.pt")
    run_ranks(check_training, world_size=3, kind="tied", checkpoint_path=path, timeout=180)


def count_gathers(monkeypatch) -> list[int]:
    """The number of weights in each all-gather FSDP starts from now on."""
    from llmsys.ddp import shards

    sizes = []
    start = shards.Gather.__init__

    def counting(self, weights, *args):
        sizes.append(len(weights))
        start(self, weights, *args)

    monkeypatch.setattr(shards.Gather, "__init__", counting)
    return sizes


def test_a_block_is_gathered_in_one_collective(monkeypatch):
    """Forward gathers each block's three weights at once (4 gathers: the embedding and the
    head, the modules outside the list, together; then the 3 blocks; where it made 11, one per
    weight); backward gathers again only what autograd saved, a block at a time."""
    gathered = count_gathers(monkeypatch)
    torch.manual_seed(0)
    model = FSDP(BlocksLM())
    tokens, targets = token_batch(torch.Generator().manual_seed(0))
    loss = token_loss(model(tokens), targets)
    assert gathered == [2, 3, 3, 3]
    gathered.clear()
    loss.backward()
    model.finish_gradient_synchronization()
    # The head (the embedding's backward needs no weight), block 2's recomputation (reentrant)
    # and block 1's (non-reentrant) gather their block whole; block 0, outside checkpointing,
    # regathers the weights autograd saved.
    assert sorted(gathered) == [1, 3, 3, 3], gathered
    assert all(p.grad is not None for p in model.parameters())


def test_a_block_is_reduce_scattered_in_one_collective(monkeypatch):
    """Backward reduce-scatters each block's three gradients at once, once the last arrived (4
    collectives: 3 blocks, then the head's and the embedding's together), and training matches
    plain training."""
    from llmsys.ddp import fsdp

    sizes = []
    reduce = fsdp.FSDP._reduce_pending

    def counting(self):
        sizes.append(len(self._pending))
        reduce(self)

    monkeypatch.setattr(fsdp.FSDP, "_reduce_pending", counting)
    torch.manual_seed(0)
    model = FSDP(BlocksLM())
    torch.manual_seed(0)
    plain = BlocksLM()
    tokens, targets = token_batch(torch.Generator().manual_seed(0))
    token_loss(model(tokens), targets).backward()
    model.finish_gradient_synchronization()
    assert sizes == [3, 3, 3, 2], sizes
    token_loss(plain(tokens), targets).backward()
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.view(-1)[: q.numel()], q.grad.view(-1), msg=name)


def check_two_blocks_per_gather(rank, world_size):
    torch.set_default_dtype(torch.float64)
    expected = train_single_process("blocks")
    model, _ = train_fsdp("blocks", rank, world_size, blocks_per_gather=2)
    assert_matches(expected, model.gather_full_params(), "2 blocks per gather", atol=1e-12)


def test_two_blocks_per_gather_train_as_one_process(two_ranks):
    two_ranks.check("two blocks per gather")


def test_two_blocks_per_gather_share_their_collectives(monkeypatch):
    """blocks_per_gather=2 over BlocksLM's 3 blocks: blocks 0 and 1 (one plain, one
    checkpointed) are gathered and reduce-scattered together, block 2 alone; the gradients are
    plain training's."""
    from llmsys.ddp import fsdp

    reduced = []
    reduce = fsdp.FSDP._reduce_pending

    def counting(self):
        reduced.append(len(self._pending))
        reduce(self)

    monkeypatch.setattr(fsdp.FSDP, "_reduce_pending", counting)
    gathered = count_gathers(monkeypatch)
    torch.manual_seed(0)
    model = FSDP(BlocksLM(), blocks_per_gather=2)
    torch.manual_seed(0)
    plain = BlocksLM()
    tokens, targets = token_batch(torch.Generator().manual_seed(0))
    for step in range(2):  # the second step prefetches, in the order the first recorded
        gathered.clear()
        reduced.clear()
        model.zero_grad()
        token_loss(model(tokens), targets).backward()
        model.finish_gradient_synchronization()
        assert reduced == [3, 6, 2], (step, reduced)
        assert gathered[:3] == [2, 6, 3], (step, gathered)  # the forward's
    plain.zero_grad()
    token_loss(plain(tokens), targets).backward()
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.view(-1)[: q.numel()], q.grad.view(-1), msg=name)


class AttentionThenCheckpointedMLP(nn.Module):
    """Selective checkpointing: the first half of the block runs plain, the second is
    recomputed in backward."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.q = nn.Linear(8, 8)
        self.o = nn.Linear(8, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.aux = nn.Linear(8, 13)  # never called in training (an eval-time head)

    def mlp(self, h):
        return self.down(torch.tanh(self.up(h)))

    def forward(self, h):
        h = h + self.o(torch.tanh(self.q(h)))
        return h + checkpoint(self.mlp, h, use_reentrant=self.reentrant)


class SelectiveLM(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(AttentionThenCheckpointedMLP(reentrant) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def full_weights_alive(shape) -> int:
    import gc
    import warnings

    gc.collect()
    with warnings.catch_warnings():  # looking at every object touches deprecated torch aliases
        warnings.simplefilter("ignore")
        return sum(
            isinstance(o, torch.Tensor) and tuple(o.shape) == shape for o in gc.get_objects()
        )


@pytest.mark.parametrize("reentrant", [False, True])
def test_selective_checkpointing_and_an_unused_layer_leave_no_full_weight(monkeypatch, reentrant):
    """A recomputation of part of a block, run in backward outside the block's forward, finds
    its weights full, and no full weight outlives the step: not the plain half's, not the
    never-called layer's. Training still matches one process."""
    torch.manual_seed(0)
    expected = SelectiveLM(reentrant).double()
    torch.manual_seed(0)
    model = FSDP(SelectiveLM(reentrant).double())
    x = torch.randn(4, 8, dtype=torch.float64)
    sizes = count_gathers(monkeypatch)
    before = full_weights_alive((13, 8))
    for net in (expected, model):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        loss = net(x).pow(2).mean()
        if net is model:
            assert sizes == [5, 5]  # forward: each block whole, the never-called aux with it
            sizes.clear()
        loss.backward()
        if net is model:
            # Each recomputation gathers its block whole (FSDP's unit), and backward gathers
            # the saved q and o again together (block 0's q alone is not saved: its input
            # needs no gradient).
            assert sorted(sizes) == [1, 2, 5, 5], sizes
            assert model._prefetched == {}
            model.finish_gradient_synchronization()
        optimizer.step()
    del loss
    assert full_weights_alive((13, 8)) == before
    assert_matches(expected, model.gather_full_params(), "selective checkpointing", atol=1e-12)


class CheckpointedMLPThenAttention(AttentionThenCheckpointedMLP):
    """The block's first module runs inside a reentrant checkpoint (no_grad in forward): the
    block's weights are made full before any of them is used with gradients."""

    def forward(self, h):
        h = h + checkpoint(self.mlp, h, use_reentrant=True)
        return h + self.o(torch.tanh(self.q(h)))


class MLPFirstLM(SelectiveLM):
    def __init__(self):
        nn.Module.__init__(self)
        self.blocks = nn.ModuleList(CheckpointedMLPThenAttention(True) for _ in range(2))


def test_a_block_first_entered_without_gradients_still_trains():
    torch.manual_seed(0)
    expected = MLPFirstLM().double()
    torch.manual_seed(0)
    model = FSDP(MLPFirstLM().double())
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    for net in (expected, model):
        net(x).pow(2).mean().backward()
    model.finish_gradient_synchronization()
    for (name, p), q in zip(model.module.named_parameters(), expected.parameters(), strict=True):
        if q.grad is None:  # aux, never called
            assert p.grad is None, name
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad.view(-1)[: q.numel()], q.grad.view(-1), msg=name)


def test_nested_module_lists_gather_per_inner_item(monkeypatch):
    stages = nn.ModuleList(nn.ModuleList(nn.Linear(8, 8) for _ in range(4)) for _ in range(2))

    class Stages(nn.Module):
        def __init__(self):
            super().__init__()
            self.stages = stages

        def forward(self, x):
            for stage in self.stages:
                for layer in stage:
                    x = torch.tanh(layer(x))
            return x

    sizes = count_gathers(monkeypatch)
    model = FSDP(Stages())
    model(torch.randn(2, 8)).sum().backward()
    model.finish_gradient_synchronization()
    # 8 layers, each gathered alone in forward and again in backward, but the first: its input
    # needs no gradient, so backward needs no weight there.
    assert sizes == [1] * 15


def test_without_a_process_group_is_plain_training_bit_for_bit():
    torch.manual_seed(0)
    expected = train_single_process("tied")
    model, _ = train_fsdp("tied", rank=0, world_size=1)
    assert model.world_size == 1
    assert_matches(expected, model.gather_full_params(), "world size 1", atol=0.0)


class MixedBlock(nn.Module):
    """One block holding a bfloat16 and a float32 weight, used in either order (backward
    delivers the gradient of the one used last first)."""

    def __init__(self, low_first: bool):
        super().__init__()
        self.low_first = low_first
        self.low = nn.Parameter(torch.randn(6, 6, dtype=torch.bfloat16))
        self.high = nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        if self.low_first:
            return (x.to(torch.bfloat16) @ self.low).float() @ self.high
        return (x @ self.high).to(torch.bfloat16) @ self.low


@pytest.mark.parametrize("low_first", [True, False])
@pytest.mark.parametrize("grads_before", ["none", "zeros"])
def test_a_block_of_two_dtypes_gets_each_gradient_in_its_parameters_dtype(grads_before, low_first):
    """The block's gradients go out in one collective per dtype: the float32 gradient is not
    rounded to bfloat16 (nor the other way round), whether .grad is set or added to."""
    torch.manual_seed(0)
    expected = MixedBlock(low_first)
    model = FSDP(nn.ModuleList([MixedBlock(low_first)]))
    model.load_state_dict({f"0.{k}": v for k, v in expected.state_dict().items()})
    if grads_before == "zeros":
        for module in (expected, model):
            for param in module.parameters():
                param.grad = torch.zeros_like(param)
    x = torch.randn(5, 6)
    expected(x).sum().backward()
    model.module[0](x).sum().backward()
    model.finish_gradient_synchronization()
    for name, want in expected.named_parameters():
        got = getattr(model.module[0], name)
        assert got.grad.dtype == want.dtype, name
        torch.testing.assert_close(got.grad, want.grad.reshape(-1), atol=0, rtol=0, msg=name)


class Dyadic(nn.Module):
    """Linear layers and ReLU on values with few significant bits: every sum is exact."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-4, 5, p.shape) / 8)

    def forward(self, tokens, x):
        return self.down(F.relu(self.up(self.embed(tokens) + x)))


def check_float32_bit_for_bit(rank, world_size):
    """In float32 the weights equal single-process training exactly where arithmetic is exact
    (the first step here); elsewhere they agree to rounding, since each rank sums its half of
    the batch before the halves are added."""
    generator = torch.Generator().manual_seed(7)
    steps = [
        (
            torch.randint(0, 8, (8,), generator=generator),
            torch.randint(-4, 5, (8, 4), generator=generator) / 4,
            torch.randint(-4, 5, (8, 2), generator=generator) / 4,
        )
        for _ in range(2)
    ]
    torch.manual_seed(0)
    reference = Dyadic()
    torch.manual_seed(rank)
    model = FSDP(Dyadic())
    single = torch.optim.SGD(reference.parameters(), lr=0.125)
    sharded = torch.optim.SGD(model.parameters(), lr=0.125)
    mine = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    for step, (tokens, x, y) in enumerate(steps):
        single.zero_grad()
        F.mse_loss(reference(tokens, x), y, reduction="sum").div(8).backward()
        single.step()
        sharded.zero_grad()
        F.mse_loss(model(tokens[mine], x[mine]), y[mine], reduction="sum").div(
            8 // world_size
        ).backward()
        model.finish_gradient_synchronization()
        sharded.step()
        got = model.gather_full_params()
        for name, value in reference.named_parameters():
            if step == 0:  # exact arithmetic: equal bit for bit
                assert torch.equal(got[name], value), name
            else:  # the weights have more bits now: sums round, in a different order
                torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6)


def test_float32_bit_for_bit(two_ranks):
    two_ranks.check("float32")


def check_compute_dtypes(rank, world_size):
    for dtype, kind in itertools.product([torch.float16, torch.bfloat16], MODELS):
        expected = train_single_process(kind, dtype, optimizer="sgd")
        model, optimizer = train_fsdp(kind, rank, world_size, dtype, optimizer="sgd")
        for param in model.parameters():  # master weights, gradients and state stay float32
            assert param.dtype == torch.float32
            if param.grad is not None:
                assert param.grad.dtype == torch.float32
                assert not optimizer.state[param]  # plain SGD keeps no state
        # Each rank rounds the gradient of its half of the batch to the compute dtype before
        # the halves are added: errors of a few units in the last place of a gradient, times the
        # learning rate. bfloat16 keeps 3 fewer bits than float16.
        atol = 1e-4 if dtype == torch.float16 else 1e-3
        assert_matches(expected, model.gather_full_params(), f"{kind} in {dtype}", atol=atol)


def test_compute_dtype_matches_single_process_casting_the_same_way(two_ranks):
    two_ranks.check("compute dtypes")


def test_compute_dtype_on_one_rank_is_the_policy_bit_for_bit():
    """Without a process group FSDP does the reference's arithmetic in the reference's order:
    equal bit for bit, so a layer cast otherwise (a norm's gain in float16, a bias left in
    float32) would show."""
    for dtype, kind in itertools.product([torch.float16, torch.bfloat16], MODELS):
        expected = train_single_process(kind, dtype, optimizer="sgd")
        model, _ = train_fsdp(kind, 0, 1, dtype, optimizer="sgd")
        assert_matches(expected, model.gather_full_params(), f"{kind} in {dtype}", atol=0.0)


def record_dtypes(modules: dict[nn.Module, tuple[str, list[str]]]) -> list:
    """Hooks noting, at each call of ``modules`` (module: its class name and its parameters'
    names, taken before the policy changed them), the class, the floating inputs' dtypes and
    the parameters' dtypes as its forward reads them. Register them after the policy's hooks,
    whose work they must see."""
    seen = []

    def record(module, args):
        layer, names = modules[module]
        inputs = [a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()]
        seen.append((layer, inputs, {name: getattr(module, name).dtype for name in names}))

    for module in modules:
        module.register_forward_pre_hook(record)
    return seen


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["tied", "blocks"])
def test_compute_dtype_casts_matmul_and_lookup_layers_and_keeps_norms(kind, dtype):
    """The policy layer by layer: every layer holding a 2-D weight (Linear, Embedding, the
    user's OwnLinear) reads its parameters and inputs in the compute dtype; a norm reads its
    float32 gain, as the single-process reference's layers do."""
    make, batch, _ = MODELS[kind]
    tokens, _ = batch(torch.Generator().manual_seed(0))
    seen = {}
    for name in ("reference", "FSDP"):
        model = make()
        modules = {
            m: (type(m).__name__, [n for n, _ in m.named_parameters(recurse=False)])
            for m in model.modules()
        }
        wrapped = mixed_precision(model, dtype) if name == "reference" else FSDP(model, dtype)
        seen[name] = record_dtypes(modules)
        wrapped(tokens)
    assert seen["FSDP"] == seen["reference"]
    for layer, inputs, params in seen["FSDP"]:
        if layer == "RMSNorm":
            assert params == {"gain": torch.float32}, inputs
        elif params:
            assert set(params.values()) == {dtype} and set(inputs) <= {dtype}, layer
    layers = {layer for layer, _, _ in seen["FSDP"]}
    assert {"Embedding", "Linear", "RMSNorm"} <= layers, layers


class TwoNormLM(nn.Module):
    """Issue 48's model: an embedding, two RMSNorms and three linear layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = RMSNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.final_norm = RMSNorm(16)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(F.silu(self.up(self.norm(h))))
        return self.head(self.final_norm(h))


def check_issue_48_mixed_precision(rank, world_size, device="cpu", atol=1e-5):
    """Issue 48's case: SGD at lr 0.01 and a batch of 20 split over the ranks, 2 steps, in
    float16 and bfloat16, against the ``mixed_precision`` reference on the whole batch."""
    generator = torch.Generator().manual_seed(48)
    steps = [torch.randint(0, 32, (2, 20, 9), generator=generator).to(device) for _ in range(2)]
    mine = slice(rank * 20 // world_size, (rank + 1) * 20 // world_size)
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        reference = mixed_precision(TwoNormLM().to(device), dtype)
        torch.manual_seed(rank)
        model = FSDP(TwoNormLM().to(device), dtype)
        for net, rows in ((reference, slice(None)), (model, mine)):
            optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
            for tokens, targets in steps:
                optimizer.zero_grad()
                token_loss(net(tokens[rows]), targets[rows]).backward()
                if net is model:
                    model.finish_gradient_synchronization()
                optimizer.step()
        label = f"issue 48 in {dtype} on {device}"
        assert_matches(reference, model.gather_full_params(), label, atol=atol)


def test_issue_48_mixed_precision_case(two_ranks):
    two_ranks.check("issue 48 mixed precision")


def check_clip_grad_norm(rank, world_size):
    """The norm is global (every slice and replicated gradient), as is the clipping."""
    inputs, targets = batches("tied", 1)[0]
    torch.manual_seed(0)
    reference = TiedLM()
    token_loss(reference(inputs), targets).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    torch.manual_seed(rank)
    model = FSDP(TiedLM())
    mine = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    token_loss(model(inputs[mine]), targets[mine]).backward()
    model.finish_gradient_synchronization()
    norm = model.clip_grad_norm_(0.1)
    assert abs(norm.item() - expected_norm.item()) <= 1e-12, (norm, expected_norm)
    # The clipped slices, gathered, are the reference's clipped gradients.
    for name, param in model.module.named_parameters():
        want = dict(reference.named_parameters())[name].grad
        if want is None:
            assert param.grad is None, name
            continue
        if param.dim() == 1 and want.dim() == 2:
            gathered = [torch.empty_like(param.grad) for _ in range(world_size)]
            torch.distributed.all_gather(gathered, param.grad)
            got = torch.cat(gathered)[: want.numel()].view_as(want)
        else:
            got = param.grad
        assert (got - want).abs().max().item() <= 1e-12, name


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="compute_dtype"):
        FSDP(nn.Linear(2, 2), compute_dtype="bf16")
    with pytest.raises(TypeError, match="compute_dtype"):
        FSDP(nn.Linear(2, 2), compute_dtype=torch.int8)
    with pytest.raises(TypeError, match="module"):
        FSDP(torch.zeros(2))
    with pytest.raises(ValueError, match="blocks_per_gather must be >= 1, got 0"):
        FSDP(nn.Linear(2, 2), blocks_per_gather=0)
    with pytest.raises(TypeError, match="blocks_per_gather must be an int, got bool"):
        FSDP(nn.Linear(2, 2), blocks_per_gather=True)
    layer = nn.Linear(3, 2)
    model = FSDP(layer)
    with pytest.raises(ValueError, match="already wrapped"):
        FSDP(layer)
    dropped = FSDP(nn.Linear(3, 2))  # freed with its model: the registry holds neither
    inner = weakref.ref(dropped.module)
    del dropped
    gc.collect()
    assert inner() is None
    with pytest.raises(ValueError, match=r"'weight'.*\(2, 3\)"):
        model.load_state_dict({"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})
    with pytest.raises(ValueError, match="max_norm"):
        model.clip_grad_norm_(0.0)
    with pytest.raises(TypeError, match="max_norm"):
        model.clip_grad_norm_("1")
    kept = layer.weight.detach().clone()
    with pytest.raises(ValueError):
        model.load_state_dict({"weight": torch.zeros(5), "bias": torch.zeros(2)})
    assert torch.equal(layer.weight.detach(), kept)  # a refused load leaves the weights alone


def check_on_gpus(rank, world_size):
    """float64 training against the reference, then bf16 compute, then issue 48's float16 and
    bfloat16 case, on one GPU per rank."""
    torch.set_default_dtype(torch.float64)
    for kind in MODELS:
        expected = train_single_process(kind, device="cuda")
        model, _ = train_fsdp(kind, rank, world_size, device="cuda")
        assert_matches(expected, model.gather_full_params(), f"{kind} on cuda", atol=1e-12)
    torch.set_default_dtype(torch.float32)
    for kind in MODELS:
        expected = train_single_process(kind, torch.bfloat16, optimizer="sgd", device="cuda")
        model, _ = train_fsdp(
            kind, rank, world_size, torch.bfloat16, optimizer="sgd", device="cuda"
        )
        assert_matches(expected, model.gather_full_params(), f"{kind} bf16 on cuda", atol=1e-3)
    expected = train_single_process("blocks", torch.bfloat16, optimizer="sgd", device="cuda")
    model, _ = train_fsdp(
        "blocks", rank, world_size, torch.bfloat16, optimizer="sgd", device="cuda",
        blocks_per_gather=2,
    )  # fmt: skip
    assert_matches(expected, model.gather_full_params(), "2 blocks per gather on cuda", atol=1e-3)
    # The issue expected 1e-4 on CUDA, where it measured 3.7e-4 under the earlier policy.
    check_issue_48_mixed_precision(rank, world_size, device="cuda", atol=1e-4)


@pytest.mark.gpu
def test_one_gpu_without_a_process_group():
    torch.manual_seed(0)
    try:
        check_on_gpus(rank=0, world_size=1)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.gpu
def test_nccl_on_two_gpus(run_ranks):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for one NCCL rank each")
    run_ranks(check_on_gpus, backend="nccl")


class PlainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class EveryBlockCheckpointed(nn.Module):
    def __init__(self, reentrant: bool, frozen: bool = False):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(4))
        self.head = nn.Linear(8, 3)
        if frozen:  # a frozen base, as under LoRA: only the biases and the head train
            for block in self.blocks:
                block.up.weight.requires_grad_(False)
                block.down.weight.requires_grad_(False)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_two_blocks_per_gather_with_every_block_checkpointed(monkeypatch, reentrant):
    """Backward recomputes one block at a time: it gathers that block alone, never a block
    whose backward is done, and nothing is left gathered when backward ends."""
    torch.manual_seed(0)
    expected = EveryBlockCheckpointed(reentrant).double()
    torch.manual_seed(0)
    model = FSDP(EveryBlockCheckpointed(reentrant).double(), blocks_per_gather=2)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    sizes = count_gathers(monkeypatch)
    for _ in range(2):  # the second step prefetches in the recorded order
        sizes.clear()
        model.zero_grad()
        model(x).sum().backward()
        assert model._prefetched == {}
        model.finish_gradient_synchronization()
        # forward: two pairs of blocks (4 weights each), then the head; backward:
        # the head, then one block (2 weights) per recomputation
        assert sizes == [4, 4, 1, 1, 2, 2, 2, 2], sizes
    expected(x).sum().backward()
    for (name, p), q in zip(model.module.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p.grad.view(-1)[: q.numel()], q.grad.view(-1), msg=name)


def test_frozen_weights_gathered_for_backward_are_released(monkeypatch):
    """A frozen weight gets no gradient to release it: backward drops its full copy after use."""
    model = FSDP(EveryBlockCheckpointed(reentrant=False, frozen=True))
    x = torch.randn(4, 8, requires_grad=True)
    before = full_weights_alive((16, 8))
    model(x).sum().backward()
    model.finish_gradient_synchronization()
    assert x.grad is not None and all(b.up.bias.grad is not None for b in model.module.blocks)
    assert full_weights_alive((16, 8)) == before


def test_blocks_are_consecutive_items_of_their_own_list():
    """Groups of two items of one list, by position: a layer shared with an earlier list stays
    in that list's group, and the same layer twice in a list counts twice."""
    from llmsys.ddp.fsdp import _blocks

    a, b, c, d = (nn.Linear(2, 2) for _ in range(4))
    model = nn.Module()
    model.enc, model.mid, model.dec = (
        nn.ModuleList([a, b]),
        nn.Linear(2, 2),
        nn.ModuleList([a, c, d]),
    )
    assert _blocks(model, [a, b, model.mid, c, d], 2) == [0, 0, 1, 2, 3]
    assert _blocks(model, [a, b, model.mid, c, d], 1) == [0, 1, 2, 3, 4]
    assert _blocks(nn.ModuleList([a, a, b, c]), [a, b, c], 2) == [0, 1, 1]


# --- block units: when a block's full weights are made, dropped and forgotten --------------------
# A block's weights are made full by the first of its modules to run and dropped by the block's
# own forward hook; these cover the paths around that: part of a block recomputed in backward,
# outside the block's forward; frozen weights that no gradient releases; a module of a block
# called on its own between steps; padded, mixed-dtype blocks on 2 and 3 ranks.


def assert_grads_match(model: FSDP, plain: nn.Module) -> None:
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.view(-1)[: q.numel()], q.grad.view(-1), msg=name)


class Stack(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(n))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_block_module_called_between_steps_does_not_serve_old_weights():
    """A module of a block called on its own (logging an activation between the gradient sync
    and the step) made its block full; the next forward gathers the stepped weights."""
    torch.manual_seed(0)
    plain = Stack().double()
    torch.manual_seed(0)
    model = FSDP(Stack().double())
    x = torch.randn(4, 8, dtype=torch.float64)
    for net in (plain, model):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        net(x).pow(2).sum().backward()
        if net is model:
            model.finish_gradient_synchronization()
            with torch.no_grad():
                model.module.blocks[0].up(x)
        optimizer.step()
        optimizer.zero_grad()
        net(x).pow(2).sum().backward()
        if net is model:
            model.finish_gradient_synchronization()
    assert_grads_match(model, plain)


class SelectiveBlock(nn.Module):
    """q runs plain; the MLP is recomputed (reentrant) in backward, outside the block's forward."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def mlp(self, h):
        return self.down(torch.tanh(self.up(h)))

    def forward(self, h):
        h = h + torch.tanh(self.q(h))
        return h + checkpoint(self.mlp, h, use_reentrant=True)


class ScaledSelective(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(SelectiveBlock() for _ in range(2))

    def forward(self, x, scale):
        x = x * scale  # autograd saves ``scale`` (x requires grad)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_freed_weight_leaves_no_address_behind_for_the_next_micro_batch():
    """After a backward whose recomputation ran part of a block, no freed full weight's address
    is still taken for a weight: a tensor of the next micro-batch allocated there (found by
    allocating until one lands there) would be replaced by the weight in backward."""
    torch.manual_seed(0)
    model = FSDP(ScaledSelective().double())
    torch.manual_seed(0)
    plain = ScaledSelective().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    one = torch.ones(8, 8, dtype=torch.float64)
    with model.no_sync():  # micro-batch 1 of 2
        model(x.clone().requires_grad_(True), one).pow(2).sum().backward()
    plain(x.clone().requires_grad_(True), one).pow(2).sum().backward()
    stale = dict(model._live)
    keep, scale = [], torch.full((8, 8), 2.0, dtype=torch.float64)
    for numel in range(64, 16384, 8) if stale else ():
        t = torch.empty(numel, dtype=torch.float64)
        if t.untyped_storage().data_ptr() in stale:
            scale = t[:64].fill_(2.0).view(8, 8)
            break
        keep.append(t)
    ours = x.clone().requires_grad_(True)
    model(ours, scale).pow(2).sum().backward()
    theirs = x.clone().requires_grad_(True)
    plain(theirs, scale.clone()).pow(2).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad)
    assert not stale, "addresses of freed full weights were still taken for weights"


class FrozenStack(nn.Module):
    """A frozen base (only biases and the head train), every block checkpointed, whole or its
    MLP only (then the block's forward hook does not run in the recomputation)."""

    def __init__(self, reentrant: bool, partial: bool):
        super().__init__()
        self.reentrant, self.partial = reentrant, partial
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(6))
        for block in self.blocks:
            block.up.weight.requires_grad_(False)
            block.down.weight.requires_grad_(False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            if self.partial:
                x = x + checkpoint(
                    lambda h, b=block: b.down(torch.tanh(b.up(h))), x, use_reentrant=self.reentrant
                )
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_frozen_recomputed_blocks_are_released_during_backward(reentrant, partial):
    torch.manual_seed(0)
    model = FSDP(FrozenStack(reentrant, partial))
    x = torch.randn(4, 8, requires_grad=True)

    def full_weights() -> int:
        return full_weights_alive((16, 8)) + full_weights_alive((8, 16))

    before = full_weights()
    at_end = []  # full weights alive when backward reaches the input
    x.register_hook(lambda grad: at_end.append(full_weights() - before))
    model(x).sum().backward()
    model.finish_gradient_synchronization()
    assert at_end[0] <= 2, f"{at_end[0]} full weights of 6 frozen blocks held at the end"


class OddBlock(nn.Module):
    """Padded sizes over 2 or 3 ranks, a float32 weight among float64 ones, a frozen weight, an
    unused one and one the block's own forward reads."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 5)
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.low = nn.Parameter(torch.randn(5, 5, dtype=torch.float32) / 3)
        self.unused = nn.Linear(5, 3)
        self.w = nn.Parameter(torch.randn(5, 5) / 3)

    def forward(self, h):
        h = h + self.b(torch.tanh(self.a(h)))
        h = torch.tanh(self.frozen(h)) @ self.w
        return h + (h.float() @ self.low).to(h.dtype)


class OddLM(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(4, 5)
        self.blocks = nn.ModuleList(OddBlock() for _ in range(5))
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if self.mode == "mixed" and i % 3 == 1:
                x = checkpoint(block, x, use_reentrant=True)
            elif self.mode == "mixed" and i % 3 == 2:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.out(x)


def check_odd_blocks(rank, world_size):
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    for mode, blocks_per_gather in [("plain", 1), ("mixed", 1), ("mixed", 2)]:
        torch.manual_seed(0)
        plain = OddLM(mode)
        torch.manual_seed(rank)
        model = FSDP(OddLM(mode), blocks_per_gather=blocks_per_gather)
        model.load_state_dict(plain.state_dict())
        generator = torch.Generator().manual_seed(5)
        for _ in range(2):  # two steps' gradients, accumulated
            x = torch.randn(6, 4, generator=generator)
            plain(x).pow(2).sum().backward()
            mine = slice(rank * 6 // world_size, (rank + 1) * 6 // world_size)
            (model(x[mine]).pow(2).sum() * world_size).backward()
            model.finish_gradient_synchronization()
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, name
                continue
            got = p.grad
            if q.dim() == 2:
                parts = [torch.empty_like(got) for _ in range(world_size)]
                dist.all_gather(parts, got.contiguous())
                got = torch.cat(parts)[: q.numel()].view_as(q)
            torch.testing.assert_close(got, q.grad, msg=f"{mode} x{blocks_per_gather} {name}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_padded_mixed_dtype_blocks_train_as_one_process(run_ranks, world_size):
    run_ranks(check_odd_blocks, world_size=world_size, timeout=120)


def test_the_state_dict_flags_take_only_a_bool():
    """Issue 49: ``strict="no"`` was taken as True, ``keep_vars="yes"`` ignored."""
    model = FSDP(BlocksLM())
    full = model.state_dict()
    for flag, value in (("strict", "no"), ("assign", None), ("strict", 1)):
        refusal = rf"FSDP.load_state_dict: `{flag}` must be a bool, got {type(value).__name__}"
        with pytest.raises(TypeError, match=refusal):
            model.load_state_dict(full, **{flag: value})
    with pytest.raises(TypeError, match=r"FSDP.state_dict: `keep_vars` must be a bool, got str"):
        model.state_dict(keep_vars="yes")
    model.load_state_dict(full, strict=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compute_dtype_with_the_fused_norm_and_loss_is_the_policy(dtype):
    """The profiling model's fused loss reads lm_head's weight outside lm_head (in the compute
    dtype under the policy), after a final norm whose float32 gain leaves float32 hidden
    states: one SGD step on one rank is the reference's, bit for bit."""
    from llmsys.profiling.config import ModelConfig
    from llmsys.profiling.model import TransformerLM

    config = ModelConfig(
        vocab_size=61, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64,
        norm="fused", loss="fused",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 61, (2, 16), generator=generator)
    targets = torch.randint(0, 61, (2, 16), generator=generator)
    torch.manual_seed(0)
    reference = mixed_precision(TransformerLM(config), dtype)
    torch.manual_seed(0)
    model = FSDP(TransformerLM(config), dtype)
    for trained in (reference, model):
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        trained(tokens, targets).backward()
        if trained is model:
            model.finish_gradient_synchronization()
        optimizer.step()
    assert_matches(reference, model.gather_full_params(), f"fused norm and loss in {dtype}", 0.0)
