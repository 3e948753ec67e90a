"""FlashAttention-2 in plain PyTorch: tiled forward with an online softmax, tiled backward.

The same algorithm as the Triton kernels, written with torch ops on tiles so that it can be read
(and run on any device) without Triton. No tile ever holds more than ``Q_TILE x K_TILE`` scores:

    forward, per query tile i:   m = -inf, l = 0, acc = 0     (l: row sums)
        for each key tile j (causal: only j up to the diagonal):
            s = q_i k_j^T * scale               (masked scores = -1e6)
            m_new = max(m, rowmax(s));  p = exp(s - m_new)
            l = l * exp(m - m_new) + rowsum(p);  acc = acc * exp(m - m_new) + p v_j
        o_i = acc / l;  L_i = m + log(l)
    backward, D = rowsum(dO * O), per key tile j and query tile i:
        P = exp(q_i k_j^T * scale - L_i)        (recomputed from L, never stored)
        dV_j += P^T dO_i;  dS = P * (dO_i v_j^T - D_i)
        dQ_i += scale * dS k_j;  dK_j += scale * dS^T q_i
"""

from __future__ import annotations

import math
from typing import Any

import torch

from llmsys.triton_launch import checks

from .reference import MASKED_SCORE

Q_TILE = 64  # query rows per tile (the issue asks for at least 16)
K_TILE = 64  # key rows per tile
TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _causal_keep(
    q_start: int, n_q: int, k_start: int, n_k: int, device: torch.types.Device
) -> torch.Tensor:
    """(n_q, n_k) bool: True where query q_start + r may see key k_start + c."""
    rows = torch.arange(q_start, q_start + n_q, device=device)[:, None]
    cols = torch.arange(k_start, k_start + n_k, device=device)[None, :]
    return cols <= rows


def flash_forward_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled attention forward on ``(..., N, d)`` tensors with equal leading dims.

    Returns ``(out, lse)``: ``out`` in q's dtype, ``lse`` ``(..., n_queries)`` in float32 (float64
    for float64 inputs), natural log.
    """
    compute = _compute_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = torch.zeros(q.shape, dtype=compute, device=q.device)  # (..., n_q, d)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=compute, device=q.device)  # (..., n_q)
    for q0 in range(0, n_q if n_k else 0, q_tile):
        q_i = q[..., q0 : q0 + q_tile, :].to(compute)  # (..., bq, d)
        rows = q_i.shape[-2]
        m = torch.full(q_i.shape[:-1], -math.inf, dtype=compute, device=q.device)  # (..., bq)
        row_sum = torch.zeros_like(m)
        acc = torch.zeros_like(q_i)  # (..., bq, d)
        k_end = min(n_k, q0 + rows) if causal else n_k  # causal: tiles past the diagonal skipped
        for k0 in range(0, k_end, k_tile):
            k_j = k[..., k0 : k0 + k_tile, :].to(compute)  # (..., bk, d)
            v_j = v[..., k0 : k0 + k_tile, :].to(compute)
            s = q_i @ k_j.transpose(-2, -1) * scale  # (..., bq, bk)
            if causal and k0 + k_j.shape[-2] - 1 > q0:  # the tile crosses the diagonal
                s = torch.where(
                    _causal_keep(q0, rows, k0, k_j.shape[-2], q.device), s, MASKED_SCORE
                )
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])  # (..., bq, bk)
            alpha = torch.exp(m - m_new)
            row_sum = row_sum * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v_j
            m = m_new
        out[..., q0 : q0 + rows, :] = acc / row_sum[..., None]
        lse[..., q0 : q0 + rows] = m + torch.log(row_sum)
    lse_dtype = torch.float64 if compute == torch.float64 else torch.float32
    return out.to(q.dtype), lse.to(lse_dtype)


def flash_backward_torch(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    q_tile: int = Q_TILE,
    k_tile: int = K_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`flash_forward_torch`, recomputing P tile by tile."""
    compute = _compute_dtype(q.dtype)
    n_q, n_k = q.shape[-2], k.shape[-2]
    delta = (grad_out.to(compute) * out.to(compute)).sum(dim=-1)  # D: (..., n_q)
    lse = lse.to(compute)
    dq = torch.zeros(q.shape, dtype=compute, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute, device=q.device)
    dv = torch.zeros(v.shape, dtype=compute, device=q.device)
    for k0 in range(0, n_k, k_tile):
        k_j = k[..., k0 : k0 + k_tile, :].to(compute)  # (..., bk, d)
        v_j = v[..., k0 : k0 + k_tile, :].to(compute)
        cols = k_j.shape[-2]
        dk_j, dv_j = torch.zeros_like(k_j), torch.zeros_like(v_j)
        q_start = (k0 // q_tile) * q_tile if causal else 0  # causal: earlier queries see none
        for q0 in range(q_start, n_q, q_tile):
            q_i = q[..., q0 : q0 + q_tile, :].to(compute)  # (..., bq, d)
            do_i = grad_out[..., q0 : q0 + q_tile, :].to(compute)
            rows = q_i.shape[-2]
            s = q_i @ k_j.transpose(-2, -1) * scale  # (..., bq, bk)
            if causal and k0 + cols - 1 > q0:
                s = torch.where(_causal_keep(q0, rows, k0, cols, q.device), s, MASKED_SCORE)
            p = torch.exp(s - lse[..., q0 : q0 + rows, None])  # (..., bq, bk)
            dv_j += p.transpose(-2, -1) @ do_i
            dp = do_i @ v_j.transpose(-2, -1)  # (..., bq, bk)
            ds = p * (dp - delta[..., q0 : q0 + rows, None])
            dq[..., q0 : q0 + rows, :] += ds @ k_j * scale
            dk_j += ds.transpose(-2, -1) @ q_i * scale
        dk[..., k0 : k0 + cols, :] = dk_j
        dv[..., k0 : k0 + cols, :] = dv_j
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def check_torch_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float | None,
    op: str = "FlashAttention2Torch",
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(op, name, t, TORCH_DTYPES)
        checks.same_dtype(op, name, t, "q", q)
        if t.dim() < 2:
            raise ValueError(
                f"{op}: `{name}` must be (..., seq, head_dim), got shape {tuple(t.shape)}"
            )
        checks.same_device(op, name, t, "q", q)
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{op}: `k` must be (..., n_keys, d) with the leading dims and d of `q` "
            f"{tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(
            f"{op}: `v` must have the shape of `k` {tuple(k.shape)}, got {tuple(v.shape)}"
        )
    check_causal_and_scale(op, is_causal, scale, "is_causal")


def check_causal_and_scale(op: str, causal: object, scale: object, causal_name: str) -> None:
    """``causal`` must be a bool and ``scale`` a finite float or None (errors name the argument)."""
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: `{causal_name}` must be a bool, got {type(causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"{op}: `scale` must be a float or None, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"{op}: `scale` must be finite, got {scale}")


class FlashAttention2Torch(torch.autograd.Function):
    """FlashAttention-2 in plain PyTorch (no Triton), as a ``torch.autograd.Function``.

    Call it as ``FlashAttention2Torch.apply(q, k, v, is_causal)`` (or with a fifth ``scale``).

    Args:
        q: ``(..., n_queries, d)``, float16, bfloat16, float32 or float64, any device.
        k: ``(..., n_keys, d)``, the leading dims, d, dtype and device of ``q``.
        v: the shape, dtype and device of ``k``.
        is_causal: bool, default False: query ``i`` sees keys ``j <= i`` (top-left aligned).
        scale: float or None (default ``1 / sqrt(d)``).

    Returns:
        ``out`` ``(..., n_queries, d)`` in q's dtype. The forward saves exactly one log-sum-exp
        tensor ``L`` of shape ``q.shape[:-1]`` (float32; float64 for float64 inputs) together with
        q, k, v and out; the backward recomputes P tile by tile from L with ``D = rowsum(dO * O)``.
        Tiles are ``Q_TILE x K_TILE`` = 64 x 64; arithmetic is float32 (float64 for float64).
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
        check_torch_inputs(q, k, v, is_causal, scale)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        out, lse = flash_forward_torch(q, k, v, is_causal, scale)
        ctx.save_for_backward(lse, q, k, v, out)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lse, q, k, v, out = ctx.saved_tensors
        dq, dk, dv = flash_backward_torch(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None
