"""The executable spec: attention with a materialized softmax, and the int8 KV cache's quantizer;
tests and benchmarks use them."""

from __future__ import annotations

import math

import torch

MASKED_SCORE = -1e6  # what a masked score is set to, as in the CS336 assignment's reference
INT8_MAX = 127  # symmetric int8: q in [-127, 127], the grid centred on 0


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T * scale) v`` with the whole score matrix in memory, and its log-sum-exp.

    Args:
        q: queries, ``(..., n_queries, d)``; for grouped-query attention ``(B, H, n_queries, d)``.
        k: keys, ``(..., n_keys, d)`` with q's leading dims, or ``(B, H_kv, n_keys, d)`` with
            ``H % H_kv == 0`` (query head ``h`` reads key head ``h // (H // H_kv)``).
        v: values, the shape of ``k``.
        is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned; see ``flash_attention``).
            Masked scores are set to ``-1e6`` before the softmax.
        scale: score scale; default ``1 / sqrt(d)``.
        upcast: compute in float64 (True, the spec) or in the inputs' dtype (False: what eager
            PyTorch gets in low precision, the yardstick for our error).

    Returns:
        ``(out, lse)``: ``out`` ``(..., n_queries, d)`` in q's dtype and ``lse`` ``(...,
        n_queries)`` float32, the natural-log log-sum-exp of each row of scaled scores.
    """
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    compute = torch.float64 if upcast else q.dtype
    q_, k_, v_ = (t.to(compute) for t in (q, k, v))
    if q.dim() == 4 and k.shape[1] != q.shape[1]:  # grouped-query attention: the spec may copy
        group = q.shape[1] // k.shape[1]
        k_, v_ = k_.repeat_interleave(group, dim=1), v_.repeat_interleave(group, dim=1)
    scores = q_ @ k_.transpose(-2, -1) * scale  # (..., n_queries, n_keys)
    if is_causal:
        n_queries, n_keys = scores.shape[-2:]
        rows = torch.arange(n_queries, device=q.device)[:, None]
        cols = torch.arange(n_keys, device=q.device)[None, :]
        scores = torch.where(cols <= rows, scores, MASKED_SCORE)
    out = torch.softmax(scores, dim=-1) @ v_  # (..., n_queries, d)
    lse = torch.logsumexp(scores, dim=-1)  # (..., n_queries)
    return out.to(q.dtype), lse.to(torch.float32)


def quantize_kv_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each token of each head (each row of the last dim), the
    rule of ``append_kv_int8``: what ``q.float() * scale[..., None]`` rebuilds is the cache.

    ``scale = max|row| / 127`` in float32 (IEEE division); ``q = round(row / scale)`` (half to
    even) clamped to [-127, 127]. A row of zeros gets scale 0 and q 0; a row holding a NaN or an
    Inf gets scale NaN and q 0, so attention over it is NaN, as over the float row.

    Args:
        x: ``(..., D)`` float16, bfloat16 or float32, ``D >= 1``.

    Returns:
        ``q`` ``(..., D)`` int8 and ``scale`` ``(...)`` float32.
    """
    x32 = x.float()  # (..., D)
    amax = x32.abs().amax(dim=-1)  # (...); NaN or inf for a non-finite row
    scale = amax / torch.full_like(amax, INT8_MAX)  # a tensor divisor: IEEE, not a reciprocal
    scale = torch.where(amax.isfinite(), scale, torch.nan)
    nonzero = scale[..., None] > 0  # False for a NaN scale
    q = (x32 / torch.where(nonzero, scale[..., None], 1.0)).clamp(-INT8_MAX, INT8_MAX).round()
    return torch.where(nonzero, q, 0.0).to(torch.int8), scale
