"""RMSNorm in Triton: Hugging Face Llama's formula, with the decoder layer's residual add fused
in front of it.

    rms_norm_fwd_kernel   x (+ residual) -> y, s, rstd        one read, one write
    rms_norm_bwd_kernel   grad_y, x, rstd -> dx, dweight partials

The int8 variant (llmsys.kernels_int8's ``rms_norm_quantize_int8``) reuses the row helpers
``_load_input``, ``_rstd``, ``_normalize``, ``_sum_of_squares`` and ``launch_config``.

The leading dims are flattened to M rows of N; each program owns BLOCK_M rows (several when N is
small). A row that fits in one block (N <= MAX_BLOCK_N) stays in registers (ONE_PASS); a longer
one is walked in BLOCK_N chunks, and what a later pass re-reads (s, dweight partials) was written
by the same program before a barrier. Offsets are 64-bit. Reading order: kernels, launchers, ops
and their fakes, autograd, public functions.
"""

from __future__ import annotations

import functools
import math
from typing import Any, overload

import torch
import triton
import triton.language as tl

from llmsys.triton_launch import (
    call_below_autograd,
    cdiv,
    checks,
    define_op,
    launch,
    next_power_of_2,
    refuse_double_backward,
    runs_under_interpreter,
    sm_count,
    wants_grad,
)

from .reference import rms_norm_backward_reference, rms_norm_reference

NAMESPACE = "llmsys_fused"

# --- kernels -------------------------------------------------------------------------------------


@triton.jit
def _load_input(x_ptr, res_ptr, s_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    # The row to normalise as float32: x, or s = x + residual rounded to x's dtype as eager adds
    # (in float32, then rounded), stored to s_ptr.
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rstd(sum_sq, N, eps):
    # 1 / sqrt(mean + eps) with IEEE division and square root: within 1 ulp, where eager's
    # rsqrt is allowed 2.
    mean = tl.div_rn(sum_sq, tl.full(sum_sq.shape, N, tl.float32))
    return tl.div_rn(tl.full(mean.shape, 1.0, tl.float32), tl.sqrt_rn(mean + eps))


@triton.jit
def _normalize(x, rstd, w, x_dtype):
    # HF: weight * (x * rstd).to(x.dtype), the product in float32 (then rounded by the caller).
    h = (x * rstd[:, None]).to(x_dtype).to(tl.float32)
    return h * w.to(tl.float32)[None, :]


@triton.jit
def _sum_of_squares(x_ptr, res_ptr, s_ptr, row_off, row_mask, N, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    # The first pass over a row longer than one block; s is written here and re-read later.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, N, BLOCK_N):
        cols = k + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols[None, :] < N)
        x = _load_input(x_ptr, res_ptr, s_ptr, row_off + cols[None, :], mask, HAS_RESIDUAL)
        acc += x * x
    tl.debug_barrier()  # s stored by this program is visible to all its threads
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["M"])
def rms_norm_fwd_kernel(
    # pointers
    x_ptr,  # (M, N) float16 / bfloat16 / float32, contiguous
    res_ptr,  # (M, N) any float dtype, or x_ptr when there is no residual
    w_ptr,  # (N,)
    y_ptr,  # (M, N) promote(x, weight) dtype
    s_ptr,  # (M, N) x's dtype: x + residual (unused without residual)
    rstd_ptr,  # (M,) float32
    # sizes
    M,
    N,
    eps,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """s = x (+ residual); rstd = 1 / sqrt(sum(s**2) / N + eps); y = w * round(s * rstd)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_mask = rows < M
    row_off = rows[:, None] * N  # (BLOCK_M, 1)
    in_ptr = s_ptr if HAS_RESIDUAL else x_ptr  # where a second pass reads the row
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols[None, :] < N)
        x = _load_input(x_ptr, res_ptr, s_ptr, row_off + cols[None, :], mask, HAS_RESIDUAL)
        rstd = _rstd(tl.sum(x * x, axis=1), N, eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        y = _normalize(x, rstd, w, x_ptr.dtype.element_ty)
        tl.store(y_ptr + row_off + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        sum_sq = _sum_of_squares(
            x_ptr, res_ptr, s_ptr, row_off, row_mask, N, HAS_RESIDUAL, BLOCK_M, BLOCK_N
        )
        rstd = _rstd(sum_sq, N, eps)
        for k in range(0, N, BLOCK_N):
            cols = k + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols[None, :] < N)
            x = tl.load(in_ptr + row_off + cols[None, :], mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
            y = _normalize(x.to(tl.float32), rstd, w, x_ptr.dtype.element_ty)
            tl.store(y_ptr + row_off + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit(do_not_specialize=["M"])
def rms_norm_bwd_kernel(
    # pointers
    g_ptr,  # (M, N) grad of y, y's dtype, contiguous
    gs_ptr,  # (M, N) grad of s, x's dtype, or g_ptr when there is none
    x_ptr,  # (M, N) the normalised input (s with a residual)
    w_ptr,  # (N,)
    rstd_ptr,  # (M,) float32, from the forward
    dx_ptr,  # (M, N) x's dtype
    dw_ptr,  # (num_programs, N) float32 partial sums of dweight, one row per program
    # sizes
    M,
    N,
    # meta-parameters
    HAS_GRAD_S: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """Program p takes row blocks p, p + P, ...; for each row (h = x * rstd, dh = g * w):

    c  = sum(dh * h) / N
    dx = rstd * (dh - h * c) (+ grad_s)
    dw_partial[p] += g * round(h)          (summed over programs by torch afterwards)
    """
    pid = tl.program_id(0)
    x_dtype = x_ptr.dtype.element_ty
    dw_row = dw_ptr + pid.to(tl.int64) * N
    if ONE_PASS:
        cols = tl.arange(0, BLOCK_N)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        # Zero this program's partial row; later row blocks add to it chunk by chunk.
        for k in range(0, N, BLOCK_N):
            cols = k + tl.arange(0, BLOCK_N)
            tl.store(dw_row + cols, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=cols < N)
        tl.debug_barrier()
    for block in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # (BLOCK_M,); M < 2**31
        row_mask = rows < M
        row_off = rows[:, None] * N  # (BLOCK_M, 1)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if ONE_PASS:
            mask = row_mask[:, None] & (cols[None, :] < N)
            offs = row_off + cols[None, :]
            h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
            g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dh = g * w[None, :]
            c = tl.sum(dh * h, axis=1) / N
            dx = rstd[:, None] * (dh - h * c[:, None])
            if HAS_GRAD_S:
                dx += tl.load(gs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + offs, dx.to(x_dtype), mask=mask)
            dw += g * h.to(x_dtype).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, N, BLOCK_N):
                cols = k + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols[None, :] < N)
                offs = row_off + cols[None, :]
                h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
                g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                acc += g * w[None, :] * h
            c = tl.sum(acc, axis=1) / N
            for k in range(0, N, BLOCK_N):
                cols = k + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols[None, :] < N)
                offs = row_off + cols[None, :]
                h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
                g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                dx = rstd[:, None] * (g * w[None, :] - h * c[:, None])
                if HAS_GRAD_S:
                    dx += tl.load(gs_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + offs, dx.to(x_dtype), mask=mask)
                # Read-modify-write of this program's own partial row: no other program
                # touches it, and the barrier below orders it between row blocks.
                dw_chunk = tl.load(dw_row + cols, mask=cols < N, other=0.0)
                dw_chunk += tl.sum(g * h.to(x_dtype).to(tl.float32), axis=0)
                tl.store(dw_row + cols, dw_chunk, mask=cols < N)
            tl.debug_barrier()
    if ONE_PASS:
        tl.store(dw_row + cols, tl.sum(dw, axis=0), mask=cols < N)


# --- launchers -----------------------------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SUPPORTED = frozenset(DTYPES)
# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(rms_norm_fwd_kernel)

# Longest row kept in registers (ONE_PASS); longer rows are walked in chunks of this many.
# The forward holds one float32 row: 16384 over 16 warps is 104 registers a thread on sm_90
# (ptxas -v, no spills). The backward holds x, g, w and the dweight sums: 8192 over 32 warps is
# 64 registers, over 16 warps 128 (so one program per SM either way), over 8 warps 254.
MAX_BLOCK_N = 16384
MAX_BLOCK_N_BWD = 8192
ROW_BLOCK_ELEMENTS = 4096  # short rows: several per program, up to this many elements
# Backward programs per SM, each looping over its rows with its own dweight partial row. Timed on
# an H100 at 8192 rows of 2048 / 3072 / 4096 bf16 (DECISIONS.md): 2 per SM with 512 elements a
# warp took 56 / 80 / 91 us, against 69 / 105 / 116 us for one per SM with 256 a warp; 4 and 8
# per SM, or 8192 elements a row block, were slower.
PROGRAMS_PER_SM = 2
CPU_PROGRAMS = 3  # the interpreter runs programs one after another; 3 covers the partial sums


def launch_config(M: int, N: int, backward: bool = False) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, ONE_PASS, num_warps) for M rows of N.

    The backward's were timed on an H100 (see PROGRAMS_PER_SM); the forward's were within 1%
    of each other for 2048 to 8192 elements a row block.
    """
    block_n = min(next_power_of_2(N), MAX_BLOCK_N_BWD if backward else MAX_BLOCK_N)
    block_m = min(max(1, ROW_BLOCK_ELEMENTS // block_n), next_power_of_2(M))
    elements = block_m * block_n
    if backward:  # 512 elements a warp: 16 values of each tensor a thread
        num_warps = min(32, max(4, elements // 512))
    else:
        num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16
    return block_m, block_n, block_n >= N, num_warps


def _max_programs(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return CPU_PROGRAMS
    return PROGRAMS_PER_SM * sm_count(t.device)


def _eps_ok(eps: float) -> bool:
    return type(eps) in (float, int) and 0 <= eps < math.inf


def check_inputs(
    op: str, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs are valid."""
    checks.tensor(op, "x", x, DTYPES)
    checks.tensor(op, "weight", weight, DTYPES)
    if x.dim() == 0:
        raise ValueError(f"{op}: `x` must have at least one dimension (..., N), got a 0-d tensor")
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"{op}: `weight` must have shape ({x.shape[-1]},) (the last dim of `x`, "
            f"{tuple(x.shape)}), got {tuple(weight.shape)}"
        )
    checks.same_device(op, "weight", weight, "x", x)
    if isinstance(eps, bool) or not isinstance(eps, float | int):
        raise TypeError(f"{op}: `eps` must be a float, got {type(eps).__name__}")
    if not _eps_ok(float(eps)):
        raise ValueError(f"{op}: `eps` must be finite and at least 0, got {eps}")
    if residual is not None:
        checks.tensor(op, "residual", residual, DTYPES)  # any float dtype: s is in x's
        checks.same_shape(op, "residual", residual, "x", x)
        checks.same_device(op, "residual", residual, "x", x)


def _valid(x: object, weight: object, eps: object, residual: object) -> bool:
    """check_inputs' verdict, cheaply: only a failure pays for the messages."""
    if not (
        type(x) is torch.Tensor
        and type(weight) is torch.Tensor
        and type(eps) is float
        and 0.0 <= eps < math.inf
        and x.dtype in _SUPPORTED
        and weight.dtype in _SUPPORTED
        and x.dim() > 0
        and weight.shape == x.shape[-1:]
    ):
        return False
    device = x.get_device()
    if weight.get_device() != device:
        return False
    return residual is None or (
        type(residual) is torch.Tensor
        and residual.dtype in _SUPPORTED
        and residual.shape == x.shape
        and residual.get_device() == device
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(M, N) contiguous: a view of a contiguous ``t``, else one copy."""
    n = t.shape[-1]
    return (t.reshape(-1, n) if n else t.reshape(math.prod(t.shape[:-1]), 0)).contiguous()


def _rms_norm_fwd_eager(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = rms_norm_reference(x, weight, eps, residual)
    y, s = (out, x.new_empty(0)) if isinstance(out, torch.Tensor) else out
    s32 = (x if residual is None else s).float()
    rstd = torch.rsqrt(s32.pow(2).mean(-1) + eps).reshape(-1)  # (M,)
    return y.contiguous(), s.contiguous(), rstd


# y's dtype. torch.promote_types is an ATen op (aten.promote_types), which a recorded replay
# refuses to record; the few dtype pairs a process meets are remembered from its first call.
promoted_dtype = functools.cache(torch.promote_types)


def residual_rows(
    x: torch.Tensor, x2: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the residual's rows, ``s``) for a row kernel over ``x2``, ``x``'s (M, N) rows: ``s`` is
    allocated for the kernel to write ``x + residual`` into; without a residual, ``x``'s rows
    and an empty ``s``."""
    if residual is None:
        return x2, x.new_empty(0)
    return _rows(residual), torch.empty(x.shape, dtype=x.dtype, device=x.device)


def row_launch(M: int, N: int, residual: torch.Tensor | None) -> tuple[int, dict, int]:
    """(grid, constexprs, num_warps) of a row kernel over (M, N) rows."""
    block_m, block_n, one_pass, num_warps = launch_config(M, N)
    constexprs = {
        "HAS_RESIDUAL": residual is not None,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "ONE_PASS": one_pass,
    }
    return cdiv(M, block_m), constexprs, num_warps


def _rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs("rms_norm_fwd", x, weight, eps, residual)
    if not x.is_cuda and not CPU_RUNS_TRITON:
        return _rms_norm_fwd_eager(x, weight, eps, residual)
    x2, weight = _rows(x), weight.contiguous()  # (M, N), (N,): the kernels read w densely
    M, N = x2.shape
    y = torch.empty(x.shape, dtype=promoted_dtype(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    res2, s = residual_rows(x, x2, residual)
    grid, constexprs, num_warps = row_launch(M, N, residual)
    args = (x2, res2, weight, y, s if residual is not None else x2, rstd, M, N, float(eps))
    launch(rms_norm_fwd_kernel, grid, args, constexprs, num_warps=num_warps)
    return y, s, rstd


def _rms_norm_fwd_fake(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs("rms_norm_fwd", x, weight, eps, residual)
    y = x.new_empty(x.shape, dtype=promoted_dtype(x.dtype, weight.dtype))
    s = x.new_empty(0) if residual is None else x.new_empty(x.shape)
    return y, s, x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


def _check_bwd(
    op: str,
    grad_y: torch.Tensor,
    grad_s: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> None:
    check_inputs(op, x, weight, 0.0, None)
    checks.tensor(op, "grad_y", grad_y, DTYPES)
    checks.same_shape(op, "grad_y", grad_y, "x", x)
    checks.same_device(op, "grad_y", grad_y, "x", x)
    if grad_s is not None:
        checks.tensor(op, "grad_s", grad_s)
        checks.same_dtype(op, "grad_s", grad_s, "x", x)
        checks.same_shape(op, "grad_s", grad_s, "x", x)
        checks.same_device(op, "grad_s", grad_s, "x", x)
    checks.tensor(op, "rstd", rstd, (torch.float32,))
    if rstd.shape != (math.prod(x.shape[:-1]),):
        raise ValueError(
            f"{op}: `rstd` must have shape ({math.prod(x.shape[:-1])},) (one per row of `x`), "
            f"got {tuple(rstd.shape)}"
        )


def _rms_norm_bwd(
    grad_y: torch.Tensor,
    grad_s: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (
        _valid(x, weight, 0.0, grad_s)
        and _valid(grad_y, weight, 0.0, None)
        and grad_y.shape == x.shape
    ):
        _check_bwd("rms_norm_bwd", grad_y, grad_s, x, weight, rstd)
    if not x.is_cuda and not CPU_RUNS_TRITON:
        dx, dweight = rms_norm_backward_reference(grad_y, grad_s, x, weight, rstd)
        return dx.contiguous(), dweight
    x2, g2, weight = _rows(x), _rows(grad_y), weight.contiguous()  # (M, N), (M, N), (N,)
    M, N = x2.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_m, block_n, one_pass, num_warps = launch_config(M, N, backward=True)
    programs = min(cdiv(M, block_m), _max_programs(x))
    if programs == 0:  # no rows: no launch, and dweight is an empty sum
        return dx, torch.zeros_like(weight)
    partial = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    constexprs = {
        "HAS_GRAD_S": grad_s is not None,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "ONE_PASS": one_pass,
    }
    gs2 = g2 if grad_s is None else _rows(grad_s)
    args = (g2, gs2, x2, weight, rstd, dx, partial, M, N)
    launch(rms_norm_bwd_kernel, programs, args, constexprs, num_warps=num_warps)
    return dx, partial.sum(0).to(weight.dtype)  # a fixed order of sums: deterministic


def _rms_norm_bwd_fake(
    grad_y: torch.Tensor,
    grad_s: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_bwd("rms_norm_bwd", grad_y, grad_s, x, weight, rstd)
    return x.new_empty(x.shape), torch.empty_like(weight)


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
rms_norm_fwd = define_op(
    _lib,
    "rms_norm_fwd(Tensor x, Tensor weight, float eps, Tensor? residual) "
    "-> (Tensor, Tensor, Tensor)",
    _rms_norm_fwd,
    _rms_norm_fwd_fake,
    replays=True,
)
rms_norm_bwd = define_op(
    _lib,
    "rms_norm_bwd(Tensor grad_y, Tensor? grad_s, Tensor x, Tensor weight, Tensor rstd) "
    "-> (Tensor, Tensor)",
    _rms_norm_bwd,
    _rms_norm_bwd_fake,
)

# --- autograd and the public functions -----------------------------------------------------------


def _setup_context(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    x, weight, _eps, residual = inputs
    _y, s, rstd = output
    ctx.has_residual = residual is not None
    ctx.save_for_backward(s if ctx.has_residual else x, weight, rstd)
    ctx.mark_non_differentiable(rstd, *(() if ctx.has_residual else (s,)))
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros


def _backward(
    ctx: Any, grad_y: torch.Tensor | None, grad_s: torch.Tensor | None, _grad_rstd: object
) -> tuple[torch.Tensor | None, ...]:
    refuse_double_backward("rms_norm")
    x, weight, rstd = ctx.saved_tensors
    grad_s = grad_s if ctx.has_residual else None
    if grad_y is None:  # only s was used: its gradient passes through the add
        dx, dweight = grad_s, None
    else:
        dx, dweight = call_below_autograd(rms_norm_bwd, grad_y, grad_s, x, weight, rstd)
    return dx, dweight, None, dx if ctx.has_residual else None


class _RMSNormFunction(torch.autograd.Function):
    """``rms_norm_fwd`` forward; dx (and d residual) and dweight from one ``rms_norm_bwd``."""

    # forward takes ctx itself: with a separate setup_context, Function.apply binds every
    # call's arguments through inspect.signature (DECISIONS.md: host cost).
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = call_below_autograd(rms_norm_fwd, x, weight, eps, residual)
        _setup_context(ctx, (x, weight, eps, residual), output)
        return output

    backward = staticmethod(_backward)


# torch.ops.llmsys_fused.rms_norm_fwd called by name is differentiable the same way.
torch.library.register_autograd(rms_norm_fwd, _backward, setup_context=_setup_context)


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., residual: None = None
) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = ..., *, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face Llama's RMSNorm in one Triton pass, optionally after the residual add.

    ``y = weight * (x32 * rsqrt(mean(x32**2, -1) + eps)).to(x.dtype)``, ``x32 = x.float()``:
    the normalised value is rounded to ``x.dtype`` and then multiplied by ``weight`` with type
    promotion, as ``LlamaRMSNorm`` does. With ``residual`` the decoder layer's add is fused in
    front: ``s = x + residual`` (in ``x.dtype``) is normalised, and both ``y`` and ``s`` are
    returned and differentiable (``x`` and ``residual`` both receive ``s``'s gradient).

    Args:
        x: (..., N) float16, bfloat16 or float32, on CUDA (Triton kernel) or CPU (eager
            reference, or the Triton kernel under ``TRITON_INTERPRET=1``).
        weight: (N,) float16, bfloat16 or float32 (float32 with bfloat16 ``x`` under autocast),
            on ``x``'s device.
        eps: a float >= 0 added to the mean square (an int is taken as a float). Default 1e-6.
        residual: None, or a tensor of ``x``'s shape and device, in any of the dtypes (the sum
            is rounded to ``x``'s: under autocast, the float32 stream plus a bfloat16 output).

    Returns:
        ``y`` of ``x``'s shape in ``torch.promote_types(x.dtype, weight.dtype)``, contiguous; with
        ``residual``, the pair ``(y, s)``, ``s`` in ``x.dtype``.

    Raises:
        TypeError: an argument is not a tensor (``eps``: not a float), or a dtype is
            unsupported.
        ValueError: ``weight`` is not (N,), ``residual``'s shape or a device differs, or ``eps``
            is negative or not finite.

    The backward computes dx in one pass from the saved per-row ``1/rms`` and dweight from
    per-program float32 partial sums reduced in a fixed order (deterministic). Works under
    ``torch.compile(fullgraph=True)`` and in CUDA graphs; double backward raises.
    """
    if not _valid(x, weight, eps, residual):
        check_inputs("rms_norm", x, weight, eps, residual)
        eps = float(eps)
    if wants_grad(x, weight, residual):
        y, s, _ = _RMSNormFunction.apply(x, weight, eps, residual)
    else:
        y, s, _ = call_below_autograd(rms_norm_fwd, x, weight, eps, residual)
    return y if residual is None else (y, s)
