"""The executable spec: each fused op in plain eager PyTorch. Tests compare with it."""

from __future__ import annotations

import torch

# --- rotary position embeddings ------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dim, where ``x1, x2`` are its two halves (Hugging Face's)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_transposed(y: torch.Tensor) -> torch.Tensor:
    """``cat(y2, -y1)``: the transpose (and inverse) of ``rotate_half``, used by the backward."""
    half = y.shape[-1] // 2
    return torch.cat((y[..., half:], -y[..., :half]), dim=-1)


def _rotary_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    compute = _rotary_compute_dtype(q.dtype) if upcast else q.dtype
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
    compute = _rotary_compute_dtype(grad_q_out.dtype)
    cos, sin = cos.to(compute).unsqueeze(1), sin.to(compute).unsqueeze(1)

    def grad(g: torch.Tensor) -> torch.Tensor:
        g = g.to(compute)
        return (g * cos + rotate_half_transposed(g * sin)).to(grad_q_out.dtype)

    return grad(grad_q_out), grad(grad_k_out)
