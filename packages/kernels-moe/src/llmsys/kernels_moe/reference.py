"""The executable spec: the padded MoE permute and unpermute in vectorized eager PyTorch.

Tests and benchmarks compare against these. They assume valid routing (the public functions check
it); the permute is an argsort by expert followed by one index copy, as most MoE layers do it.
"""

from __future__ import annotations

import torch


def padded_counts_reference(tokens_per_expert: torch.Tensor, align: int) -> torch.Tensor:
    """``ceil(tokens_per_expert / align) * align``, elementwise (0 stays 0)."""
    return (tokens_per_expert + align - 1) // align * align


def padded_moe_permute_reference(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    topk: int,
    num_experts: int,
    *,
    align: int = 128,
    out_rows: int | None = None,
    return_row_index: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Group the rows of ``x`` by expert, each expert's group padded with zero rows to ``align``.

    Same arguments and results as :func:`llmsys.kernels_moe.padded_moe_permute`; see there.
    ``num_experts`` is implied by ``tokens_per_expert`` and only kept for the same signature.
    """
    num_tokens, hidden = x.shape
    experts = top_experts.reshape(-1).long()  # (N,) pairs in token-major order
    counts = tokens_per_expert.long()  # (E,)
    padded = padded_counts_reference(counts, align)  # (E,)
    padded_start = torch.cumsum(padded, 0) - padded  # (E,) first row of each expert
    start = torch.cumsum(counts, 0) - counts  # (E,) the same without padding
    order = torch.argsort(experts, stable=True)  # (N,) pairs by expert, token order kept
    sorted_experts = experts[order]  # (N,)
    rank = torch.arange(experts.numel(), device=x.device) - start[sorted_experts]
    rows = padded_start[sorted_experts] + rank  # (N,) padded row of each sorted pair
    n_rows = int(padded.sum()) if out_rows is None else out_rows
    out = x.new_zeros(n_rows, hidden)
    out.index_copy_(0, rows, x.index_select(0, order // topk))  # (n_rows, hidden)
    result: tuple[torch.Tensor, ...] = (out, padded.to(tokens_per_expert.dtype))
    if return_row_index:
        row_index = torch.empty_like(rows).index_copy_(0, order, rows)  # (N,)
        result += (row_index.view(num_tokens, topk).to(torch.int32),)
    return result


def moe_unpermute_reference(
    expert_out: torch.Tensor,
    row_index: torch.Tensor,
    routing_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[t] = sum_k w[t, k] * expert_out[row_index[t, k]]``, accumulated in float32.

    Rows of -1 (dropped pairs) contribute nothing. Float64 inputs accumulate in float64. The
    result has ``expert_out``'s dtype. Differentiable through eager autograd.
    """
    compute = torch.float64 if expert_out.dtype == torch.float64 else torch.float32
    rows = row_index.long()  # (T, K)
    kept = rows >= 0
    gathered = expert_out[rows.clamp_min(0)].to(compute)  # (T, K, H)
    weights = kept.to(compute)
    if routing_weights is not None:
        weights = routing_weights.to(compute) * weights  # (T, K)
    return (gathered * weights[..., None]).sum(1).to(expert_out.dtype)  # (T, H)
