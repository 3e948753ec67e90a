"""The executable spec: each fused op written plainly in eager PyTorch. Tests and benchmarks
compare against these; on CPU without ``TRITON_INTERPRET=1`` the public functions run them."""

from __future__ import annotations

import math
from typing import overload

import torch
import torch.nn.functional as F

# --- RMSNorm -------------------------------------------------------------------------------------


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float32 (as Hugging Face upcasts), float64 for
    float64 inputs (the tests' exact reference)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@overload
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., residual: None = None
) -> torch.Tensor: ...
@overload
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face Llama's RMSNorm, optionally after the decoder layer's residual add.

    ``y = weight * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)`` with ``x32 = x.float()``:
    the normalised value is rounded to ``x.dtype`` before the multiply, and the output dtype is
    ``torch.promote_types(weight.dtype, x.dtype)`` (float32 for bfloat16 x under autocast with a
    float32 weight). With ``residual``, ``s = x + residual`` in ``x.dtype`` is normalised instead
    and returned too.

    Args:
        x: (..., N) float16, bfloat16 or float32 (float64 for the tests' exact reference).
        weight: (N,).
        eps: added to the mean square.
        residual: None, or a tensor of ``x``'s shape (any of the dtypes; the sum is rounded to
            ``x``'s, as an in-place ``x += residual`` would be).

    Returns:
        ``y`` (..., N), or ``(y, s)`` with ``residual``.
    """
    s = x if residual is None else (x + residual).to(x.dtype)
    s32 = s.to(compute_dtype(s.dtype))
    variance = s32.pow(2).mean(-1, keepdim=True)
    y = weight * (s32 * torch.rsqrt(variance + eps)).to(s.dtype)
    return y if residual is None else (y, s)


def rms_norm_backward_reference(
    grad_y: torch.Tensor,
    grad_s: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`rms_norm_reference` from the saved per-row ``rstd``, in float32.

    With ``h = x * rstd``: ``dh = grad_y * weight``,
    ``dx = rstd * (dh - h * mean(dh * h, -1)) (+ grad_s)`` and
    ``dweight = sum over rows of grad_y * h.to(x.dtype)`` (the rounding is the forward's).

    Args:
        grad_y: (..., N), the gradient of ``y``.
        grad_s: None, or (..., N): the gradient of ``s`` from its other uses (residual path).
        x: (..., N), the normalised input (``s`` with a residual).
        weight: (N,).
        rstd: (M,) float32, ``1 / sqrt(mean(x**2) + eps)`` per row, rows flattened.

    Returns:
        ``dx`` in ``x.dtype`` and ``dweight`` in ``weight.dtype``.
    """
    compute = compute_dtype(x.dtype)
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).to(compute)  # (M, N)
    g = grad_y.reshape(x2.shape).to(compute)  # (M, N)
    r = rstd.to(compute)[:, None]  # (M, 1)
    h = x2 * r  # (M, N)
    dh = g * weight.to(compute)  # (M, N)
    dx = r * (dh - h * (dh * h).mean(-1, keepdim=True))  # (M, N)
    if grad_s is not None:
        dx = dx + grad_s.reshape(x2.shape).to(compute)
    dweight = (g * h.to(x.dtype).to(compute)).sum(0)  # (N,)
    return dx.to(x.dtype).reshape(x.shape), dweight.to(weight.dtype)


# --- fused linear cross-entropy -------------------------------------------------------------------


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` as a Hugging Face causal LM computes it.

    The logits come out of the matmul in its dtype (under ``torch.autocast``: the autocast
    dtype), are upcast to float32 (float64 logits stay float64) and go to ``F.cross_entropy``.
    This materialises the full (N, V) logits; ``linear_cross_entropy`` never does.

    Args:
        hidden: (..., H) floating.
        weight: (V, H), the lm_head weight.
        target: (...) int64 class indices, or ``ignore_index``.
        bias: optional (V,).
        ignore_index, label_smoothing, reduction: as ``F.cross_entropy``.

    Returns:
        The loss: 0-d for "mean" and "sum", (...) for "none"; float32 (float64 for float64).
    """
    logits = F.linear(hidden, weight, bias)
    if logits.dtype != torch.float64:
        logits = logits.float()
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


# --- rotary position embeddings ------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dim, where ``x1, x2`` are its two halves (Hugging Face's)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_transposed(y: torch.Tensor) -> torch.Tensor:
    """``cat(y2, -y1)``: the transpose (and inverse) of ``rotate_half``, used by the backward."""
    half = y.shape[-1] // 2
    return torch.cat((y[..., half:], -y[..., :half]), dim=-1)


def rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    upcast: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for ``x`` in ``(q, k)``: Hugging Face's
    ``apply_rotary_pos_emb(q, k, cos, sin)`` with ``unsqueeze_dim=1``.

    Args:
        q: ``(B, Hq, S, D)``, floating dtype, ``D`` even.
        k: ``(B, Hk, S, D)``, the dtype of ``q``.
        cos, sin: ``(B or 1, S, D)``, broadcast over the heads.
        upcast: False: eager in ``q``'s dtype, with ``cos`` and ``sin`` cast to it first (what the
            Llama attention computes: three roundings per element in bfloat16). True: computed in
            float32 (float64 for float64 inputs) and rounded once to ``q``'s dtype, which is what
            the Triton kernel does.

    Returns:
        ``(q_out, k_out)`` in ``q``'s dtype.
    """
    compute = compute_dtype(q.dtype) if upcast else q.dtype
    cos, sin = cos.to(compute).unsqueeze(1), sin.to(compute).unsqueeze(1)  # (B|1, 1, S, D)

    def embed(x: torch.Tensor) -> torch.Tensor:
        x = x.to(compute)
        return (x * cos + rotate_half(x) * sin).to(q.dtype)

    return embed(q), embed(k)


def rotary_backward_reference(
    grad_q_out: torch.Tensor, grad_k_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``rotary_reference`` with respect to ``q`` and ``k``, computed in float32
    (float64 for float64 inputs) and rounded once.

    ``out = x * cos + R x * sin`` with ``R = rotate_half`` a linear map, so
    ``grad_x = g * cos + R^T (g * sin)`` with ``R^T y = cat(y2, -y1)``. Per half:
    ``grad_x1 = g1 * cos1 + g2 * sin2`` and ``grad_x2 = g2 * cos2 - g1 * sin1``. (With Llama's
    ``cos``/``sin``, whose halves are equal, this is the rotation by ``-angle``.)
    """
    compute = compute_dtype(grad_q_out.dtype)
    cos, sin = cos.to(compute).unsqueeze(1), sin.to(compute).unsqueeze(1)

    def grad(g: torch.Tensor) -> torch.Tensor:
        g = g.to(compute)
        return (g * cos + rotate_half_transposed(g * sin)).to(grad_q_out.dtype)

    return grad(grad_q_out), grad(grad_k_out)
