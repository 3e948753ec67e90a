"""SiLU-and-mul fused with the per-token quantization ``down_proj`` needs: one row-wise kernel.

    int8_silu_mul_quantize(Tensor gate, Tensor up) -> (Tensor q, Tensor scale)

A gated MLP computes ``down_proj(silu(gate) * up)``. In W8A8 the hidden rows are quantized per
token before ``down_proj``, and a per-token scale needs the whole row's maximum, which no single
output tile of the gate/up GEMM holds; so this kernel runs one program per row, reads ``gate``
and ``up`` (twice for rows longer than one block) and writes the int8 row and its scale: the
hidden rows never reach memory in float. The spec is
:func:`~llmsys.kernels_int8.silu_mul_quantize_int8_reference`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from llmsys.triton_launch import (
    call_below_autograd,
    checks,
    define_op,
    launch,
    runs_under_interpreter,
)
from llmsys.triton_launch.precise import exp as _exp

from . import tuning
from .kernels import _abs_nan_as_inf, _quantize, _store_scale
from .ops import FLOAT_DTYPES, NAMESPACE
from .reference import silu_mul_quantize_int8_reference

# --- kernel --------------------------------------------------------------------------------------


@triton.jit
def _silu_mul(g, u, DTYPE: tl.constexpr, PRECISE: tl.constexpr):
    # g, u float32 -> silu(g) * u in float32, rounded as eager rounds `F.silu(gate) * up` in
    # DTYPE: silu(g) = g / (1 + exp(-g)) (PyTorch's formula, IEEE division: `/` is an
    # approximation on the GPU) rounded to DTYPE, then the product rounded to DTYPE.
    silu = tl.div_rn(g, 1.0 + _exp(-g, PRECISE)).to(DTYPE).to(tl.float32)
    return (silu * u).to(DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def silu_mul_quantize_int8_kernel(
    # pointers
    gate_ptr,  # (M, N) float16 / bfloat16 / float32, any strides
    up_ptr,  # (M, N) gate's dtype, any strides
    q_ptr,  # (M, N) int8, unit column stride
    scale_ptr,  # (M,) gate's dtype
    # sizes
    M,
    N,
    # strides
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    stride_qm,
    # meta-parameters
    BLOCK_N: tl.constexpr,  # columns per step (>= N when ONE_PASS)
    ONE_PASS: tl.constexpr,  # the row fits in one block: gate and up are read once
    PRECISE: tl.constexpr,  # libdevice's exp and rint; False under the interpreter
):
    """One row per program:

        h     = round(round(silu(gate[m])) * up[m])       in gate's dtype (eager's roundings)
        scale = round_to_dtype(max_n |h[n]| / 127)        NaN where h holds a NaN or an Inf
        q[m]  = rint(clamp(h / scale, -127, 127))         0 where scale is 0 or NaN

    Masked lanes load gate = up = 0, so h = 0 there and never wins the maximum. A row longer than
    one block takes two passes over gate and up (the first asking L2 to keep them) and computes
    h in both, so h never needs a buffer.
    """
    # A (1,)-row block, so the package's quantizer helpers (_store_scale, _quantize) apply as is.
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # (1,)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    g_rows = gate_ptr + rows[:, None] * stride_gm  # (1, 1)
    u_rows = up_ptr + rows[:, None] * stride_um
    q_rows = q_ptr + rows[:, None] * stride_qm
    dtype = gate_ptr.dtype.element_ty
    if ONE_PASS:
        mask = row_mask[:, None] & (cols[None, :] < N)  # (1, BLOCK_N)
        offs = cols[None, :].to(tl.int64)
        g = tl.load(g_rows + offs * stride_gn, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_rows + offs * stride_un, mask=mask, other=0.0).to(tl.float32)
        h = _silu_mul(g, u, dtype, PRECISE)  # (1, BLOCK_N)
        scale = _store_scale(scale_ptr, rows, row_mask, tl.max(_abs_nan_as_inf(h), axis=1))
        tl.store(q_rows + cols[None, :], _quantize(h, scale, PRECISE), mask=mask)
    else:
        amax = tl.zeros((1,), dtype=tl.float32)
        for k in range(0, N, BLOCK_N):
            mask = row_mask[:, None] & (k + cols[None, :] < N)
            offs = (k + cols[None, :]).to(tl.int64)
            g = tl.load(
                g_rows + offs * stride_gn, mask=mask, other=0.0, eviction_policy="evict_last"
            )
            u = tl.load(
                u_rows + offs * stride_un, mask=mask, other=0.0, eviction_policy="evict_last"
            )
            h = _silu_mul(g.to(tl.float32), u.to(tl.float32), dtype, PRECISE)
            amax = tl.maximum(amax, tl.max(_abs_nan_as_inf(h), axis=1))
        scale = _store_scale(scale_ptr, rows, row_mask, amax)
        for k in range(0, N, BLOCK_N):
            mask = row_mask[:, None] & (k + cols[None, :] < N)
            offs = (k + cols[None, :]).to(tl.int64)
            g = tl.load(
                g_rows + offs * stride_gn, mask=mask, other=0.0, eviction_policy="evict_first"
            )
            u = tl.load(
                u_rows + offs * stride_un, mask=mask, other=0.0, eviction_policy="evict_first"
            )
            h = _silu_mul(g.to(tl.float32), u.to(tl.float32), dtype, PRECISE)
            tl.store(q_rows + k + cols[None, :], _quantize(h, scale, PRECISE), mask=mask)


# --- launcher ------------------------------------------------------------------------------------

CPU_RUNS_TRITON = runs_under_interpreter(silu_mul_quantize_int8_kernel)


def launch_config(n: int) -> tuple[int, bool, int]:
    """(BLOCK_N, ONE_PASS, num_warps) for rows of ``n``: the quantizer's measured row policy
    (``tuning.quantize_config``: one pass up to 4096 columns, else two passes of 2048 or 4096,
    which beat one 16-warp pass at 11008 columns on an H100, DECISIONS.md). Not yet measured
    for this kernel, which reads two inputs and computes an exp per element."""
    config = tuning.quantize_config(1, n)
    return config.block_k, config.one_pass, config.num_warps


def check_inputs(op: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless ``gate`` and ``up`` are
    float tensors of one dtype, shape and device, with at least one dimension."""
    checks.tensor(op, "gate", gate, FLOAT_DTYPES)
    checks.tensor(op, "up", up, FLOAT_DTYPES)
    if gate.dim() == 0:
        raise ValueError(
            f"{op}: `gate` must have at least one dimension (..., N), got a 0-d tensor"
        )
    checks.same_dtype(op, "up", up, "gate", gate)
    checks.same_shape(op, "up", up, "gate", gate)
    checks.same_device(op, "up", up, "gate", gate)


def silu_mul_quantize(
    gate: torch.Tensor, up: torch.Tensor, config: tuple[int, bool, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's implementation (CPU and CUDA): ``gate``, ``up`` (M, N). ``config`` forces a
    :func:`launch_config` (the tests run both passes this way)."""
    op = "int8_silu_mul_quantize"
    check_inputs(op, gate, up)
    if gate.dim() != 2:
        raise ValueError(f"{op}: `gate` must be 2-D (M, N), got shape {tuple(gate.shape)}")
    if not gate.is_cuda and not CPU_RUNS_TRITON:
        return silu_mul_quantize_int8_reference(gate, up)
    m, n = gate.shape
    q = torch.empty((m, n), dtype=torch.int8, device=gate.device)  # (M, N)
    scale = torch.empty((m,), dtype=gate.dtype, device=gate.device)  # (M,)
    if m == 0:
        return q, scale
    if n == 0:
        return q, scale.zero_()
    block_n, one_pass, num_warps = config or launch_config(n)
    launch(
        silu_mul_quantize_int8_kernel,
        m,
        (gate, up, q, scale, m, n, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
         q.stride(0)),
        {"BLOCK_N": block_n, "ONE_PASS": one_pass, "PRECISE": gate.is_cuda},
        num_warps=num_warps,
        enable_fp_fusion=False,  # keep eager's separate roundings
    )  # fmt: skip
    return q, scale


# --- registration --------------------------------------------------------------------------------


def _silu_mul_quantize_fake(
    gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("int8_silu_mul_quantize", gate, up)
    return gate.new_empty(gate.shape, dtype=torch.int8), gate.new_empty(gate.shape[:1])


def _no_grad_outputs(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    ctx.mark_non_differentiable(*output)


def _no_backward(ctx: Any, *grads: torch.Tensor) -> None:
    return None  # never runs: the outputs need no gradient


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
int8_silu_mul_quantize = define_op(
    _lib,
    "int8_silu_mul_quantize(Tensor gate, Tensor up) -> (Tensor, Tensor)",
    silu_mul_quantize,
    _silu_mul_quantize_fake,
    replays=True,
)
torch.library.register_autograd(
    int8_silu_mul_quantize, _no_backward, setup_context=_no_grad_outputs
)


# --- public function -----------------------------------------------------------------------------


def silu_mul_quantize_int8(
    gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8_perrow(F.silu(gate) * up)`` in one Triton pass, one program per row.

    ``F.silu(gate)`` is rounded to the inputs' dtype, then the product, as eager PyTorch does;
    then the package's symmetric per-row quantization: ``scale = max|h_row| / 127`` (float32,
    rounded to the dtype) and ``q = round_half_even(h / scale)`` clamped to [-127, 127]. An
    all-zero row gives scale 0 and zeros; a row holding a NaN or an Inf (after SiLU-and-mul) a
    NaN scale and zeros. The outputs carry no gradient (inference).

    Args:
        gate: (..., N) float16, bfloat16 or float32, any strides (the first half of a fused
            gate/up GEMM's output, say), on CUDA (Triton) or CPU (the eager spec, or the
            Triton kernel under ``TRITON_INTERPRET=1``).
        up: ``gate``'s shape, dtype and device, any strides.

    Returns:
        ``q`` (M, N) int8, contiguous, with the leading dims flattened to M (the int8 GEMM's
        ``a``), and ``scale`` (M,) in ``gate.dtype``.

    Raises:
        TypeError: ``gate`` or ``up`` is not a float16/bfloat16/float32 tensor, or their dtypes
            differ.
        ValueError: ``gate`` is 0-d, or ``up``'s shape or device differs.
    """
    check_inputs("silu_mul_quantize_int8", gate, up)
    rows = math.prod(gate.shape[:-1])
    n = gate.shape[-1]
    return call_below_autograd(int8_silu_mul_quantize, gate.reshape(rows, n), up.reshape(rows, n))
