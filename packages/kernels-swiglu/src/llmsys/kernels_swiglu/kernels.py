"""Triton kernels for SwiGLU: one fused pass forward, one fused pass backward.

Both kernels treat the inputs as flat contiguous vectors of ``n_elements`` and give each program
``BLOCK_SIZE`` consecutive elements:

    forward:   out = round(round(silu(a)) * b)                3 tensors moved (eager moves 5)
    backward:  da  = g * b * s * (1 + a * (1 - s)),  s = sigmoid(a)
               db  = g * round(silu(a))                       5 tensors moved (eager moves 9)

Offsets are 64-bit so tensors past 2**31 elements index correctly.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _exp_neg(a, PRECISE: tl.constexpr):
    # libdevice's exp is correctly rounded to within 1 ulp like CUDA's expf, which eager uses;
    # tl.exp is the faster ex2.approx path. Only the precise one rounds silu to the same
    # float16 as eager on all 65536 inputs (2 differ otherwise; bfloat16 agrees either way).
    # The interpreter has no libdevice and computes exp exactly in numpy.
    if PRECISE:
        return libdevice.exp(-a)
    else:
        return tl.exp(-a)


@triton.jit
def _div(a, b, COMPUTE_DTYPE: tl.constexpr):
    # Eager divides with IEEE rounding; Triton's float32 `/` is the 2-ulp `div.full`.
    if tl.float32 == COMPUTE_DTYPE:
        return tl.div_rn(a, b)
    else:
        return a / b


@triton.jit
def swiglu_fwd_kernel(
    # pointers
    a_ptr,
    b_ptr,
    out_ptr,
    # sizes
    n_elements,
    # meta-parameters
    COMPUTE_DTYPE: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    # Round silu(a) to the input dtype before the multiply, exactly as eager does.
    x = a.to(COMPUTE_DTYPE)
    silu = _div(x, 1.0 + _exp_neg(x, PRECISE), COMPUTE_DTYPE).to(a.dtype)
    out = silu.to(COMPUTE_DTYPE) * b.to(COMPUTE_DTYPE)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(
    # pointers
    grad_out_ptr,
    a_ptr,
    b_ptr,
    grad_a_ptr,
    grad_b_ptr,
    # sizes
    n_elements,
    # meta-parameters
    COMPUTE_DTYPE: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    g = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0, eviction_policy="evict_first")
    g = g.to(COMPUTE_DTYPE)
    a = a.to(COMPUTE_DTYPE)
    denominator = 1.0 + _exp_neg(a, PRECISE)
    sig = 1.0 / denominator
    silu = _div(a, denominator, COMPUTE_DTYPE).to(b.dtype).to(COMPUTE_DTYPE)  # as in forward
    grad_a = g * b.to(COMPUTE_DTYPE) * sig * (1.0 + a * (1.0 - sig))
    grad_b = g * silu
    tl.store(grad_a_ptr + offsets, grad_a.to(grad_a_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_b_ptr + offsets, grad_b.to(grad_b_ptr.dtype.element_ty), mask=mask)
