"""Shared helpers for the kernels-moe tests: random routings, an independent loop spec."""

from __future__ import annotations

import math

import torch

from llmsys.kernels_moe import ops
from llmsys.triton_launch import forget


def set_switch(monkeypatch, name: str, value) -> None:
    """``ops.<name> = value`` (a helper or switch the ops' impls read) until ``monkeypatch``
    undoes it, and the ops' recorded replays forgotten, as they were recorded with the old value.
    (The root conftest forgets them again before the next test.)"""
    monkeypatch.setattr(ops, name, value)
    forget(ops.moe_permute, ops.moe_unpermute, ops.moe_unpermute_backward)


def random_routing(num_tokens, topk, num_experts, device, *, duplicates=False, skew=False):
    """(top_experts (T, k) int64, tokens_per_expert (E,) int64) for a random routing.

    Without duplicates every token picks ``topk`` distinct experts; ``skew`` favours low ids so
    that some experts get many tokens and others none.
    """
    if duplicates:
        top = torch.randint(0, num_experts, (num_tokens, topk))
    else:
        scores = torch.rand(num_tokens, num_experts)
        if skew:
            scores = scores * torch.linspace(4.0, 0.1, num_experts)
        top = scores.argsort(dim=1, descending=True)[:, :topk]
    counts = torch.bincount(top.reshape(-1), minlength=num_experts)
    return top.to(device), counts.to(device)


def permute_spec(x, top_experts, tokens_per_expert, align, out_rows=None):
    """The permute written as the issue states it, one pair at a time (independent of argsort)."""
    counts = [int(c) for c in tokens_per_expert]
    padded = [math.ceil(c / align) * align for c in counts]
    starts = [sum(padded[:e]) for e in range(len(padded))]
    rows = sum(padded) if out_rows is None else out_rows
    out = torch.zeros(rows, x.shape[1], dtype=x.dtype)
    row_index = torch.empty(top_experts.shape, dtype=torch.int32)
    nxt = list(starts)
    for t in range(top_experts.shape[0]):
        for k in range(top_experts.shape[1]):
            e = int(top_experts[t, k])
            out[nxt[e]] = x[t].cpu()
            row_index[t, k] = nxt[e]
            nxt[e] += 1
    return out, torch.tensor(padded), row_index


def rand(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, device=device).to(dtype)
