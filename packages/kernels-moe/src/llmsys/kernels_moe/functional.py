"""The public, differentiable permute and unpermute."""

from __future__ import annotations

from typing import Any

import torch

from llmsys.triton_launch import call_below_autograd, checks, refuse_double_backward, wants_grad

from . import ops  # registers torch.ops.llmsys.moe_*


class _PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        top_experts: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        num_experts: int,
        align: int,
        out_rows: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out, padded, row_index = call_below_autograd(
            ops.moe_permute, x, top_experts, tokens_per_expert, num_experts, align, out_rows
        )
        ctx.save_for_backward(row_index)
        ctx.mark_non_differentiable(padded, row_index)
        return out, padded, row_index

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, _grad_padded: object, _grad_row_index: object
    ) -> tuple[torch.Tensor | None, ...]:
        # Each token was copied to its topk rows: its gradient is the sum of theirs.
        refuse_double_backward("padded_moe_permute")
        (row_index,) = ctx.saved_tensors
        grad_x = call_below_autograd(ops.moe_unpermute, grad_out, row_index, None)
        return grad_x, None, None, None, None, None


class _UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        expert_out: torch.Tensor,
        row_index: torch.Tensor,
        routing_weights: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(expert_out, row_index, routing_weights)
        return call_below_autograd(ops.moe_unpermute, expert_out, row_index, routing_weights)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward("moe_unpermute")
        expert_out, row_index, routing_weights = ctx.saved_tensors
        weights_grad = ctx.needs_input_grad[2]
        grad_src, grad_weights = call_below_autograd(
            ops.moe_unpermute_backward, grad_y, expert_out, row_index, routing_weights, weights_grad
        )
        return grad_src, None, grad_weights if weights_grad else None


def _check_permute_arguments(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    topk: int,
    num_experts: int,
    align: int,
    out_rows: int | None,
) -> None:
    """What the dispatcher would reject before the op could name the argument (non-tensors,
    non-int sizes), and ``topk``, which the op does not take. The tensors' dtypes, shapes and
    devices are checked once, in the op (``ops.check_permute_inputs``, which repeats the int
    checks for direct calls of the op)."""
    op = "padded_moe_permute"
    checks.tensors(op, x=x, top_experts=top_experts, tokens_per_expert=tokens_per_expert)
    checks.integer(op, "topk", topk, 1)
    checks.integer(op, "num_experts", num_experts, 1)
    checks.integer(op, "align", align, 1)
    if out_rows is not None:
        checks.integer(op, "out_rows", out_rows, 0)
    if top_experts.dim() == 2 and top_experts.shape[1] != topk:  # other ranks: the op says so
        raise ValueError(
            f"{op}: `top_experts` must have topk={topk} columns, got shape "
            f"{tuple(top_experts.shape)}"
        )
    if topk > num_experts:
        raise ValueError(f"{op}: `topk` must be at most num_experts={num_experts}, got {topk}")


def padded_moe_permute(
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
    """Group token rows by expert, each expert's group padded with zero rows to ``align`` rows.

    Pair ``(t, k)`` (token ``t``'s ``k``-th choice) goes to expert ``top_experts[t, k]``. The
    output holds the experts' groups in expert order; inside a group, tokens in ascending order (a
    token that chose an expert twice appears twice, in k order); every group starts at a multiple
    of ``align``; padding rows are zeros::

        experts 0..3, align 4, tokens_per_expert [1, 0, 6, 2]:
        row  0 1 2 3 | 4 5 6 7 8 9 10 11 | 12 13 14 15
             a 0 0 0 | b c d e f g  0  0 | h  i  0  0      (expert 1: no rows at all)

    Args:
        x: (num_tokens, hidden) float16, bfloat16, float32 or float64 token rows.
        top_experts: (num_tokens, topk) integer expert ids in [0, num_experts).
        tokens_per_expert: (num_experts,) integer: how many pairs chose each expert (the
            histogram of ``top_experts``).
        topk: experts per token, at most ``num_experts``; equals ``top_experts.shape[1]``.
        num_experts: number of experts, at least 1.
        align: every group starts at a multiple of this (any int >= 1; 128 suits FP8 grouped
            GEMMs that read groups with the TMA). Default 128.
        out_rows: None (default): the output has exactly ``padded_tokens_per_expert.sum()``
            rows, which costs one host sync. An int: the output has ``out_rows`` rows, rows past
            the groups are zeros, and nothing waits on the host, so the call can be captured in
            a CUDA graph; ``num_tokens * topk + num_experts * (align - 1)`` always suffices.
        return_row_index: also return ``row_index``.

    Returns:
        ``(padded_tokens, padded_tokens_per_expert)``, plus ``row_index`` if asked:
        ``padded_tokens`` (rows, hidden) in ``x``'s dtype; ``padded_tokens_per_expert``
        (num_experts,) in ``tokens_per_expert``'s dtype, ``ceil(count / align) * align``;
        ``row_index`` (num_tokens, topk) int32, the output row of every pair, which
        :func:`moe_unpermute` takes. Differentiable in ``x``: the gradient of a token is the sum
        of its rows' gradients.

    Raises:
        TypeError: a non-tensor, a non-floating ``x``, non-integer ids or counts, a non-int
            ``topk``, ``num_experts``, ``align`` or ``out_rows``.
        ValueError: wrong shapes, ``topk`` larger than ``num_experts``, mismatched devices,
            ``out_rows`` smaller than ``num_tokens * topk``; and with ``out_rows=None`` also
            expert ids outside [0, num_experts) and ``tokens_per_expert`` different from the
            histogram of ``top_experts`` (the routing kernels compute both for free and the
            one sync reads them back).

    With ``out_rows`` given, nothing data-dependent is checked (that would need a sync); the
    result stays memory-safe: pairs with bad ids, pairs beyond their expert's count and pairs
    whose row would be ``out_rows`` or more are dropped (``row_index`` -1, no row written), and
    every row that no pair fills is zero. Counts larger than the histogram leave zero rows.
    """
    _check_permute_arguments(x, top_experts, tokens_per_expert, topk, num_experts, align, out_rows)
    args = (x, top_experts, tokens_per_expert, num_experts, align, out_rows)
    if wants_grad(x):
        out, padded, row_index = _PermuteFunction.apply(*args)
    else:
        out, padded, row_index = call_below_autograd(ops.moe_permute, *args)
    return (out, padded, row_index) if return_row_index else (out, padded)


def moe_unpermute(
    expert_out: torch.Tensor,
    row_index: torch.Tensor,
    routing_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine each token's expert outputs: ``y[t] = sum_k w[t, k] * expert_out[row_index[t, k]]``.

    Args:
        expert_out: (rows, hidden) float16, bfloat16, float32 or float64, e.g. the experts'
            outputs over :func:`padded_moe_permute`'s rows. Padding rows are never read.
        row_index: (num_tokens, topk) integer, as :func:`padded_moe_permute` returns it. A row
            of -1 marks a dropped pair, which contributes nothing; rows outside [0, rows) are
            treated the same way (not checked: that would need a host sync). The rows of
            different pairs must differ, as the permute's do, or their gradients race.
        routing_weights: optional (num_tokens, topk) floating weights, default all ones.

    Returns:
        (num_tokens, hidden) in ``expert_out``'s dtype, summed in float32 (float64 for float64
        inputs) and rounded once. Differentiable in ``expert_out`` (its padding rows get zero
        gradient) and ``routing_weights``. No host sync; CUDA-graph safe.

    Raises:
        TypeError: non-tensors, non-floating ``expert_out`` or weights, non-integer rows.
        ValueError: wrong shapes or mismatched devices.
    """
    # The op checks the rest once (ops.check_unpermute_inputs).
    checks.tensors(
        "moe_unpermute",
        ("routing_weights",),
        expert_out=expert_out,
        row_index=row_index,
        routing_weights=routing_weights,
    )
    if wants_grad(expert_out, routing_weights):
        return _UnpermuteFunction.apply(expert_out, row_index, routing_weights)
    return call_below_autograd(ops.moe_unpermute, expert_out, row_index, routing_weights)
