"""The executable spec: per-row INT8 quantization and the W8A8 GEMM in eager PyTorch.

Tests and benchmarks compare against these functions; on CPU without ``TRITON_INTERPRET=1`` the
public functions run them.
"""

from __future__ import annotations

import copy
import math
from types import MethodType

import torch
import torch.nn.functional as F

from llmsys.kernels_fused import rms_norm_reference

QMAX = 127  # symmetric: q in [-127, 127], so -q never overflows and the grid is centred on 0


def quantize_int8_perrow_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8 quantization.

    ``scale = max|row| / 127`` is computed in float32 and rounded to ``x.dtype``; ``q`` divides by
    that stored scale (so ``q * scale`` is what a consumer reconstructs), rounds half to even and
    clamps to [-127, 127]. A row whose scale is 0 (all zeros, or a float16 scale that underflows)
    gives zeros, never NaN.

    Non-finite inputs: a row holding a NaN or an Inf gets ``scale`` NaN and ``q`` all zeros, so
    ``q * scale`` and every GEMM output of that row are NaN (as in float arithmetic, where the
    row's products would be non-finite too). Finite rows are unaffected.

    Args:
        x: (M, K) float16, bfloat16 or float32.

    Returns:
        ``q`` (M, K) int8, contiguous, and ``scale`` (M,) in ``x.dtype``.
    """
    x32 = x.float()  # (M, K)
    # (M,); an empty row has no maximum: call it 0
    amax = x32.abs().amax(dim=1) if x.shape[1] else x32.new_zeros(x.shape[0])
    # Divide by a tensor: eager CUDA turns `tensor / python_scalar` into a multiply by the
    # reciprocal, which can land one float32 ulp away from the IEEE quotient.
    scale = amax / torch.full_like(amax, QMAX)  # (M,); amax is NaN or inf for a non-finite row
    scale = torch.where(amax.isfinite(), scale, torch.nan).to(x.dtype)  # (M,)
    s32 = scale.float()[:, None]  # (M, 1)
    nonzero = s32 > 0  # False for a NaN scale: the row's q is 0
    q = (x32 / torch.where(nonzero, s32, 1.0)).clamp(-QMAX, QMAX).round()  # (M, K)
    q = torch.where(nonzero, q, 0.0)
    return q.to(torch.int8).contiguous(), scale


def quantize_int8_reference(
    weight: torch.Tensor, axis: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column (``axis=0``) or per-row (``axis=1``) quantization of a 2-D weight.

    Args:
        weight: (K, N) float16, bfloat16 or float32.
        axis: 0 reduces over K (one scale per column, ``scale`` (N,), ``q`` column-major with
            ``q.stride() == (1, K)``); 1 or -1 reduces over N (one scale per row, ``q`` row-major).
    """
    if axis in (0, -2):
        q, scale = quantize_int8_perrow_reference(weight.t())  # q (N, K) row-major
        return q.t(), scale  # (K, N) column-major
    return quantize_int8_perrow_reference(weight)


def matmul_int8_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``(a @ b) * a_scale[:, None] * b_scale[None, :] (+ bias)``, rounded once to the output dtype.

    The integer product is exact (float64 holds every sum of int8 products below 2**53), is then
    rounded to float32, scaled in float32 in this order, and cast last: the kernel's epilogue.

    Args:
        a: (M, K) int8.
        a_scale: (M,) float16, bfloat16 or float32.
        b: (K, N) int8, any strides.
        b_scale: (N,) float16, bfloat16 or float32.
        bias: optional (N,) float16, bfloat16 or float32, added in float32 after the scales.
        out_dtype: the output dtype; default ``a_scale.dtype``.

    Returns:
        (M, N) in ``out_dtype``.
    """
    acc = (a.double() @ b.double()).float()  # (M, N) exact integers, then one rounding
    out = acc * a_scale.float()[:, None] * b_scale.float()[None, :]  # (M, N)
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype or a_scale.dtype)


def matmul_quantize_int8_reference(
    fpa: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """Quantize the rows of ``fpa`` (the floating-point ``a``, (..., K)), then
    :func:`matmul_int8_reference`: (..., N)."""
    q, scale = quantize_int8_perrow_reference(fpa.reshape(-1, fpa.shape[-1]))  # (M, K), (M,)
    out = matmul_int8_reference(q, scale, b, b_scale)  # (M, N)
    return out.reshape(*fpa.shape[:-1], b.shape[1])


def silu_mul_quantize_int8_reference(
    gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8_perrow_reference(F.silu(gate) * up)``: a gated MLP's hidden rows quantized
    per token for ``down_proj``.

    ``F.silu(gate)`` is rounded to the inputs' dtype, then the product, as eager PyTorch rounds
    ``act_fn(gate) * up`` in a Hugging Face MLP.

    Args:
        gate: (..., N) float16, bfloat16 or float32.
        up: ``gate``'s shape and dtype.

    Returns:
        ``q`` (M, N) int8 with the leading dims flattened to M, and ``scale`` (M,) in
        ``gate.dtype``.
    """
    hidden = F.silu(gate) * up  # (..., N)
    return quantize_int8_perrow_reference(
        hidden.reshape(math.prod(gate.shape[:-1]), gate.shape[-1])
    )


def rms_norm_quantize_int8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`quantize_int8_perrow_reference` of ``llmsys.kernels_fused.rms_norm_reference``'s
    output (Hugging Face Llama's RMSNorm, optionally after the residual add).

    Returns:
        ``(q, scale)``, or ``(q, scale, s)`` with ``residual``: ``q`` (M, N) int8 with the leading
        dims of ``x`` flattened to M, ``scale`` (M,) in the normalised output's dtype, ``s`` the
        sum ``x + residual`` in ``x``'s shape.
    """
    out = rms_norm_reference(x, weight, eps, residual)
    y, rest = (out, ()) if isinstance(out, torch.Tensor) else (out[0], out[1:])
    q, scale = quantize_int8_perrow_reference(y.reshape(math.prod(x.shape[:-1]), x.shape[-1]))
    return (q, scale, *rest)


def _w8a8_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8_perrow_reference(x.reshape(-1, x.shape[-1]))  # (M, K), (M,)
    q_w, scale_w = quantize_int8_perrow_reference(self.weight)  # per output channel: (N, K), (N,)
    out = matmul_int8_reference(q, scale, q_w.t(), scale_w, self.bias)  # (M, N)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def w8a8_reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of ``model`` whose plain ``nn.Linear`` layers compute the package's W8A8
    scheme with the eager spec: inputs quantized per token, weights per output channel, the
    exact integer product rescaled (:func:`matmul_int8_reference`). What ``quantize_model`` and
    ``quantize_linears`` are measured against (issue 26's "fp32 model running the same W8A8
    scheme"); everything else (norms, SiLU, attention) runs the model's own float32 code.

    Args:
        model: any module; it is not modified.

    Returns:
        The copy, in float32, on ``model``'s device.
    """
    reference = copy.deepcopy(model).float()
    for module in reference.modules():
        if type(module) is torch.nn.Linear:
            # an instance's forward replaced on purpose: this copy's layers compute the scheme
            module.forward = MethodType(_w8a8_linear_forward, module)  # type: ignore[method-assign]
    return reference
