"""The Triton FlashAttention-2 as an autograd Function, and the public ``flash_attention``."""

from __future__ import annotations

import math
from typing import Any

import torch

from llmsys.triton_launch import call_below_autograd, checks, refuse_double_backward, wants_grad

from . import ops
from .flash_torch import check_causal_and_scale


def _check_arguments(
    op: str, q: object, k: object, v: object, causal: object, scale: object, causal_name: str
) -> None:
    """What the dispatcher would reject before the op could name the argument; the op checks
    the rest (shapes, dtypes, devices) once, in ``ops.check_inputs``. The common call (three
    tensors, a bool, no scale) passes a cheap test; only another call pays for the full checks
    and their messages (about 1 us of host time a call on an H100 host)."""
    if (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and type(causal) is bool
        and scale is None
    ):
        return
    checks.tensors(op, q=q, k=k, v=v)
    check_causal_and_scale(op, causal, scale, causal_name)


def _default_scale(q: torch.Tensor) -> float:
    """``1 / sqrt(head_dim)``; 1.0 where q has no head dim yet (the op then names the error)."""
    return 1.0 / math.sqrt(q.shape[-1]) if q.dim() and q.shape[-1] else 1.0


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2 with a fused Triton forward and a deterministic Triton backward.

    Call it as ``FlashAttention2Triton.apply(q, k, v, is_causal)`` (or with a fifth ``scale``);
    the arguments, shapes and semantics are those of :func:`flash_attention`.

    The forward saves exactly one log-sum-exp tensor ``L`` of shape ``q.shape[:-1]`` (float32,
    natural log) together with q, k, v and the output; the backward recomputes P tile by tile
    from L in two kernels: dQ (which also writes ``D = rowsum(dO * O)``), then dK/dV, no
    atomics, so two backward runs give bitwise-identical gradients.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        _check_arguments("FlashAttention2Triton", q, k, v, is_causal, scale, "is_causal")
        scale = _default_scale(q) if scale is None else float(scale)
        out, lse = call_below_autograd(ops.flash_attn2_fwd, q, k, v, is_causal, scale)
        ctx.save_for_backward(lse, q, k, v, out)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_double_backward("flash_attention")
        lse, q, k, v, out = ctx.saved_tensors
        dq, dk, dv = call_below_autograd(
            ops.flash_attn2_bwd, grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale
        )
        return dq, dk, dv, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` without materializing the scores, differentiable.

    Args:
        q: queries, ``(B, N_q, d)`` or ``(B, H, N_q, d)``; float16, bfloat16 or float32 (float32
            runs its dot products in TF32: "fp32 = tf32 dots"); any strides (a ``(B, N, H, d)``
            tensor transposed to ``(B, H, N, d)`` is read in place). ``d`` from 1 to 256, any
            value: the kernels pad it to a power of two (16 at least) with masked lanes.
        k: keys, ``(B, N_k, d)`` or ``(B, H_kv, N_k, d)`` where ``H_kv`` divides ``H``
            (grouped-query attention: query head ``h`` reads key head ``h // (H // H_kv)``,
            in place; neither pass expands k, v or their gradients to H heads). Same dtype
            and device as q; ``N_k`` may differ from ``N_q``; any lengths.
        v: values, the shape, dtype and device of ``k``.
        causal: bool, default False. Query ``i`` sees keys ``j <= i``, counted from the start of
            both sequences (top-left aligned, like ``torch.nn.functional.
            scaled_dot_product_attention``; FlashAttention-2's CUDA package aligns bottom-right
            instead). For N_q = 3, N_k = 5 (x: seen, .: masked)::

                      keys 0 1 2 3 4
                query 0    x . . . .
                query 1    x x . . .
                query 2    x x x . .

            Masked scores behave as if set to -1e6 (their probability is exactly 0); every
            query sees key 0, so no row is empty.
        scale: float or None (default ``1 / sqrt(d)``), multiplies the scores.

    Returns:
        A new contiguous tensor, q's shape and dtype. CUDA tensors run the Triton kernels; CPU
        tensors run them under ``TRITON_INTERPRET=1``, else the plain-PyTorch FlashAttention-2.
        Works under ``torch.compile(fullgraph=True)``. Double backward is not supported.

    Raises:
        TypeError: an argument is not a tensor (or bool / float), or a dtype is unsupported or
            differs from q's.
        ValueError: shapes, head counts, head dims (above 256) or devices do not fit.
    """
    _check_arguments("flash_attention", q, k, v, causal, scale, "causal")
    try:
        if wants_grad(q, k, v):
            return FlashAttention2Triton.apply(q, k, v, causal, scale)
        scale = _default_scale(q) if scale is None else float(scale)
        return call_below_autograd(ops.flash_attn2_fwd, q, k, v, causal, scale)[0]
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "flash_attention") from None
