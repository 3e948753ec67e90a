"""RMSNorm (after the residual add, optionally) fused with the per-token quantization the next
int8 GEMM reads: one row-wise kernel.

    int8_rms_norm_quantize(Tensor x, Tensor weight, float eps, Tensor? residual)
        -> (Tensor q, Tensor scale, Tensor s)

The normalised rows are llmsys.kernels_fused's ``rms_norm`` (Hugging Face Llama's formula; the
norm's Triton helpers and launch policy are imported from there), quantized with this package's
helpers: the rows never reach memory in float. The spec is
:func:`~llmsys.kernels_int8.rms_norm_quantize_int8_reference`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmsys.kernels_fused.rms_norm import (
    _load_input,
    _normalize,
    _rows,
    _rstd,
    _sum_of_squares,
    _valid,
    check_inputs,
    promoted_dtype,
    residual_rows,
    row_launch,
)
from llmsys.triton_launch import call_below_autograd, define_op, launch, wants_grad

from .kernels import _abs_nan_as_inf, _quantize, _store_scale
from .ops import CPU_RUNS_TRITON, NAMESPACE
from .reference import rms_norm_quantize_int8_reference

# --- kernel --------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def rms_norm_quantize_int8_kernel(
    # pointers
    x_ptr,  # (M, N) float16 / bfloat16 / float32, contiguous
    res_ptr,  # (M, N) any float dtype, or x_ptr when there is no residual
    w_ptr,  # (N,)
    q_ptr,  # (M, N) int8
    scale_ptr,  # (M,) promote(x, weight) dtype: the dtype y is rounded to before quantizing
    s_ptr,  # (M, N) x's dtype: x + residual (unused without residual)
    # sizes
    M,
    N,
    eps,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr,
    PRECISE: tl.constexpr,  # libdevice's rint; False under the interpreter
):
    """y as ``rms_norm_fwd_kernel`` rounds it, then per row:

        scale = round_to_dtype(max|y| / 127)       NaN where y holds a NaN or Inf
        q     = rint(clamp(y / scale, -127, 127))  0 where scale is 0 or NaN

    Lanes past the row count as 0 in the maximum. A row longer than one block takes three passes
    (sum of squares, max, quantize).
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_mask = rows < M
    row_off = rows[:, None] * N  # (BLOCK_M, 1)
    x_dtype = x_ptr.dtype.element_ty
    y_dtype = scale_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols[None, :] < N)
        x = _load_input(x_ptr, res_ptr, s_ptr, row_off + cols[None, :], mask, HAS_RESIDUAL)
        rstd = _rstd(tl.sum(x * x, axis=1), N, eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        y = _normalize(x, rstd, w, x_dtype).to(y_dtype).to(tl.float32)
        amax = tl.max(_abs_nan_as_inf(tl.where(mask, y, 0.0)), axis=1)
        scale = _store_scale(scale_ptr, rows, row_mask, amax)
        tl.store(q_ptr + row_off + cols[None, :], _quantize(y, scale, PRECISE), mask=mask)
    else:
        sum_sq = _sum_of_squares(
            x_ptr, res_ptr, s_ptr, row_off, row_mask, N, HAS_RESIDUAL, BLOCK_M, BLOCK_N
        )
        rstd = _rstd(sum_sq, N, eps)
        in_ptr = s_ptr if HAS_RESIDUAL else x_ptr
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, N, BLOCK_N):
            cols = k + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < N)
            x = tl.load(in_ptr + row_off + cols[None, :], mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
            y = _normalize(x.to(tl.float32), rstd, w, x_dtype).to(y_dtype).to(tl.float32)
            amax = tl.maximum(amax, tl.max(_abs_nan_as_inf(tl.where(mask, y, 0.0)), axis=1))
        scale = _store_scale(scale_ptr, rows, row_mask, amax)
        for k in range(0, N, BLOCK_N):
            cols = k + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < N)
            x = tl.load(in_ptr + row_off + cols[None, :], mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
            y = _normalize(x.to(tl.float32), rstd, w, x_dtype).to(y_dtype).to(tl.float32)
            tl.store(q_ptr + row_off + cols[None, :], _quantize(y, scale, PRECISE), mask=mask)


# --- launcher and registration -------------------------------------------------------------------


def rms_norm_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's implementation (CPU and CUDA): check, allocate, launch."""
    check_inputs("int8_rms_norm_quantize", x, weight, eps, residual)
    if not x.is_cuda and not CPU_RUNS_TRITON:
        q, scale, *summed = rms_norm_quantize_int8_reference(x, weight, eps, residual)
        return q, scale, summed[0].contiguous() if summed else x.new_empty(0)
    x2, weight = _rows(x), weight.contiguous()  # (M, N), (N,): the kernel reads w densely
    M, N = x2.shape
    q = torch.empty((M, N), dtype=torch.int8, device=x.device)
    scale = torch.empty(M, dtype=promoted_dtype(x.dtype, weight.dtype), device=x.device)
    res2, s = residual_rows(x, x2, residual)
    grid, constexprs, num_warps = row_launch(M, N, residual)
    constexprs["PRECISE"] = x.is_cuda
    args = (x2, res2, weight, q, scale, s if residual is not None else x2, M, N, float(eps))
    launch(rms_norm_quantize_int8_kernel, grid, args, constexprs, num_warps=num_warps)
    return q, scale, s


def _rms_norm_quantize_fake(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs("int8_rms_norm_quantize", x, weight, eps, residual)
    M = math.prod(x.shape[:-1])
    q = x.new_empty((M, x.shape[-1]), dtype=torch.int8)
    scale = x.new_empty(M, dtype=promoted_dtype(x.dtype, weight.dtype))
    return q, scale, x.new_empty(0) if residual is None else x.new_empty(x.shape)


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
int8_rms_norm_quantize = define_op(
    _lib,
    "int8_rms_norm_quantize(Tensor x, Tensor weight, float eps, Tensor? residual) "
    "-> (Tensor, Tensor, Tensor)",
    rms_norm_quantize,
    _rms_norm_quantize_fake,
    replays=True,
)


# --- public function -----------------------------------------------------------------------------


def rms_norm_quantize_int8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``llmsys.kernels_fused.rms_norm``, then this package's symmetric per-row int8
    quantization of its output, in one kernel.

    Equals :func:`quantize_int8_perrow_reference` applied to ``rms_norm(x, weight, eps)`` bit for
    bit: ``scale = max|y_row| / 127`` (float32, rounded to y's dtype), ``q = round_half_even(y /
    scale)`` clamped to [-127, 127]; an all-zero row gives zeros and scale 0, a row holding a NaN
    or Inf a NaN scale and zeros. For serving: forward only, the outputs carry no gradient.

    Args:
        x: (..., N) float16, bfloat16 or float32, on CUDA (Triton) or CPU (the eager spec, or the
            Triton kernel under ``TRITON_INTERPRET=1``).
        weight: (N,) float16, bfloat16 or float32, on ``x``'s device.
        eps: a float >= 0 added to the mean square (an int is taken as a float). Default 1e-6.
        residual: None, or a tensor of ``x``'s shape and device, any of the dtypes (added first,
            the sum rounded to ``x``'s dtype).

    Returns:
        ``(q, scale)``, or ``(q, scale, s)`` with ``residual``: ``q`` (M, N) int8 contiguous,
        the leading dims of ``x`` flattened to M (the int8 GEMM's ``a``); ``scale`` (M,) in
        ``torch.promote_types(x.dtype, weight.dtype)``; ``s = x + residual`` in ``x``'s shape
        and dtype.

    Raises:
        TypeError: an argument is not a tensor (``eps``: not a float), or a dtype is
            unsupported.
        ValueError: ``weight`` is not (N,), ``residual``'s shape or a device differs, or ``eps``
            is negative or not finite.
    """
    if not _valid(x, weight, eps, residual):
        check_inputs("rms_norm_quantize_int8", x, weight, eps, residual)
        eps = float(eps)
    if wants_grad(x, weight, residual):  # forward only: nothing for autograd to record
        x, weight = x.detach(), weight.detach()
        residual = None if residual is None else residual.detach()
    q, scale, s = call_below_autograd(int8_rms_norm_quantize, x, weight, eps, residual)
    return (q, scale) if residual is None else (q, scale, s)
