"""The executable spec: SwiGLU in eager PyTorch. Tests and benchmarks compare against this."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` exactly as eager PyTorch computes it.

    Eager rounds ``silu(a)`` to ``a.dtype`` before the multiply; the Triton kernel reproduces that
    double rounding so the two agree bit for bit in bfloat16 and float16.

    Args:
        a: gate input, any shape, floating dtype.
        b: up-projection input, same shape, dtype and device as ``a``.

    Returns:
        ``silu(a) * b`` with the shape and dtype of ``a``.
    """
    return F.silu(a) * b


def swiglu_backward_reference(
    grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``silu(a) * b``, computed in float32 (float64 for float64 inputs).

    ``d/da = grad * b * sigmoid(a) * (1 + a * (1 - sigmoid(a)))`` and ``d/db = grad * silu(a)``.
    """
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    g, a32, b32 = (t.to(compute) for t in (grad_out, a, b))
    sig = torch.sigmoid(a32)
    grad_a = g * b32 * sig * (1 + a32 * (1 - sig))
    grad_b = g * a32 * sig
    return grad_a.to(a.dtype), grad_b.to(b.dtype)
