"""A tiny model, its data and training loop, shared by the tests and their rank functions.

Sharded training is checked against unsharded training at a fixed number of tokens per step:
the reference steps a plain optimizer on the whole batch in one process; each of N ranks takes
1/N of the rows and averages its gradients with the others (what DDP does), then steps a
:class:`ShardedOptimizer`. Models are float64, so the two agree to ~1e-15 after a few steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HIDDEN = 11, 6, 7
ROWS, SEQ = 8, 5  # one batch: ROWS sequences of SEQ tokens, split by rows across the ranks
ATOL = 1e-10  # sharded vs unsharded, float64 (the gradients differ by summation order only)

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01}),
}


class TinyLM(nn.Module):
    """Every case an optimizer wrapper must survive: an output head tied to the embedding (one
    tensor used twice), a frozen layer (``requires_grad=False``) and a parameter that never
    receives a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, HIDDEN)
        self.frozen = nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.out = nn.Linear(HIDDEN, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embedding.weight
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)  # (B, T, WIDTH)
        h = self.frozen(torch.tanh(self.hidden(x)))  # (B, T, HIDDEN)
        return self.head(x + self.out(h))  # (B, T, VOCAB)


def make_model(seed: int = 0) -> TinyLM:
    """The same float64 model on every rank (and in the reference) for the same seed."""
    torch.manual_seed(seed)
    return TinyLM().double()


def param_groups(model: TinyLM, *, tied_twice: bool = False) -> list[dict]:
    """Two groups with their own learning rates. ``tied_twice`` lists the tied weight again,
    as the head's, which the sharded optimizer must count once."""
    first = [model.embedding.weight, *model.hidden.parameters()]
    if tied_twice:
        first.append(model.head.weight)
    rest = [*model.frozen.parameters(), *model.out.parameters(), model.unused]
    return [{"params": first, "lr": 0.02}, {"params": rest, "lr": 0.005, "weight_decay": 0.0}]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, next-token targets) of training step ``step``, each (ROWS, SEQ)."""
    data = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return data[:, :-1], data[:, 1:]


def backward(model: nn.Module, step: int, rank: int = 0, world_size: int = 1) -> None:
    """The gradient of the mean loss over ``step``'s whole batch: each rank's over its rows,
    averaged across the ranks."""
    device = next(model.parameters()).device
    tokens, targets = (t.to(device) for t in batch(step))
    rows = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    logits = model(tokens[rows])
    F.cross_entropy(logits.flatten(0, 1), targets[rows].flatten()).backward()
    if world_size > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world_size


def train(model, optimizer, steps, *, start=0, rank=0, world_size=1, clip=None, scheduler=None):
    """``steps`` training steps from step ``start``; ``clip()`` (if given) runs between the
    backward and the step. Returns what ``clip`` returned at each step."""
    clipped = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        backward(model, step, rank, world_size)
        if clip is not None:
            clipped.append(clip())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return clipped


def assert_same_parameters(model: nn.Module, reference: nn.Module, atol: float = ATOL) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
