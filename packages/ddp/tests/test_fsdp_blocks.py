"""FSDP's block units: when a block's full weights are made, dropped and forgotten.

A block's weights are made full by the first of its modules to run and dropped by the block's
own forward hook; these tests cover the paths around that: a part of a block recomputed in
backward, outside the block's forward; frozen weights that no gradient releases; a module of a
block called on its own between steps; padded, mixed-dtype blocks on 2 and 3 ranks. Gradients
are compared with plain training of the same model (float64).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llmsys.ddp import FSDP


def alive(*shapes) -> int:
    gc.collect()
    with warnings.catch_warnings():  # looking at every object touches deprecated torch aliases
        warnings.simplefilter("ignore")
        return sum(
            isinstance(o, torch.Tensor) and tuple(o.shape) in shapes for o in gc.get_objects()
        )


def assert_grads_match(model: FSDP, plain: nn.Module) -> None:
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.view(-1)[: q.numel()], q.grad.view(-1), msg=name)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class Stack(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(n))
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
        self.blocks = nn.ModuleList(MLP() for _ in range(6))
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
    before = alive((16, 8), (8, 16))
    at_end = []  # full weights alive when backward reaches the input
    x.register_hook(lambda grad: at_end.append(alive((16, 8), (8, 16)) - before))
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
