"""The public functions: quantize per row or column, multiply in int8, or both at once; and the
ops' autograd, which is none: inference-only."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from llmsys.triton_launch import call_below_autograd, checks, wants_grad

from . import ops  # registers torch.ops.llmsys.int8_*

# The ops by name: the quantizer's outputs never require grad, and the GEMMs refuse inputs that
# want a gradient. (torch.library.register_autograd takes only functional ops; the out= GEMM
# gets a plain Autograd kernel that refuses or runs below autograd.)


def _no_grad_outputs(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, ...]) -> None:
    ctx.mark_non_differentiable(*output)


def _refuse(name: str) -> Callable[[Any, tuple, object], None]:
    def setup_context(ctx: Any, inputs: tuple, output: object) -> None:
        raise ops.inference_only_error(f"torch.ops.llmsys.{name}")

    return setup_context


def _no_backward(ctx: Any, *grads: torch.Tensor) -> None:
    return None  # never runs: setup_context refused, or marked the outputs as needing no grad


torch.library.register_autograd(
    ops.int8_quantize_perrow, _no_backward, setup_context=_no_grad_outputs
)
torch.library.register_autograd(ops.int8_matmul, _no_backward, setup_context=_refuse("int8_matmul"))
torch.library.register_autograd(
    ops.int8_matmul_quantize, _no_backward, setup_context=_refuse("int8_matmul_quantize")
)


def _matmul_out_autograd(*args: Any) -> None:
    if wants_grad(*args):
        raise ops.inference_only_error("torch.ops.llmsys.int8_matmul_out")
    with torch._C._AutoDispatchBelowAutograd():
        return ops.int8_matmul_out(*args)


torch.library.impl("llmsys::int8_matmul_out", "Autograd", _matmul_out_autograd)

# The dispatcher's own schema error for a non-tensor is a RuntimeError that names no argument:
# the public functions check argument types first (checks.tensors).


def quantize_int8_perrow(
    x: torch.Tensor, *, check_finite: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8 quantization (one Triton pass over ``x``).

    ``scale = max|row| / 127`` (float32, rounded to ``x.dtype``) and ``q = round(x / scale)``
    clamped to [-127, 127], rounding half to even and dividing by the stored scale. An all-zero
    row gives ``scale`` 0 and zeros, never NaN or Inf.

    Args:
        x: (M, K) float16, bfloat16 or float32, any strides, on CUDA (Triton) or CPU (the eager
            reference, or the Triton kernel under ``TRITON_INTERPRET=1``).
        check_finite: keyword-only, default False: a row holding a NaN or Inf quantizes to a
            NaN scale and zeros (its GEMM outputs are NaN). True: such a row raises a
            ``ValueError`` naming it (a device sync; skipped under ``torch.compile`` and
            CUDA-graph capture).

    Returns:
        ``q`` (M, K) int8, contiguous, and ``scale`` (M,) in ``x.dtype``. Neither requires grad.

    Raises:
        TypeError: ``x`` is not a tensor or not float16/bfloat16/float32; ``check_finite`` is
            not a bool.
        ValueError: ``x`` is not 2-D.
    """
    checks.tensors("quantize_int8_perrow", x=x)
    if check_finite is not False:  # (the default costs one comparison)
        checks.flag("quantize_int8_perrow", "check_finite", check_finite)
        ops.check_finite_rows("quantize_int8_perrow", "x", x)
    try:
        return call_below_autograd(ops.int8_quantize_perrow, x)
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "quantize_int8_perrow") from None


def quantize_int8(
    weight: torch.Tensor, axis: int = 0, *, check_finite: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight per column (``axis=0``, for the GEMM's B) or per row (``axis=1``).

    Args:
        weight: (K, N) float16, bfloat16 or float32.
        axis: the dimension reduced over. 0 (or -2): one scale per column, ``scale`` (N,), and
            ``q`` (K, N) column-major, ``q.stride() == (1, K)``, the layout
            :func:`matmul_int8` reads fastest. 1 (or -1): per row, as
            :func:`quantize_int8_perrow`. Default 0.
        check_finite: keyword-only, default False; as :func:`quantize_int8_perrow`, per
            quantized row (a column of ``weight`` for ``axis=0``).

    Returns:
        ``(q, scale)`` as above, ``scale`` in ``weight.dtype``.

    Raises:
        TypeError: ``weight`` is not a float16/bfloat16/float32 tensor; ``check_finite`` is not
            a bool.
        ValueError: ``weight`` is not 2-D, or ``axis`` is not 0, 1, -2 or -1.

    For an ``nn.Linear`` weight (N, K), ``quantize_int8(linear.weight.t())`` gives the (K, N)
    operand ``y = x @ W.T`` needs (``Int8Linear.from_float`` does this).
    """
    checks.tensor("quantize_int8", "weight", weight, ops.FLOAT_DTYPES)
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8: `weight` must be 2-D (K, N), got {tuple(weight.shape)}")
    if isinstance(axis, bool) or axis not in (0, 1, -1, -2):
        raise ValueError(f"quantize_int8: `axis` must be 0 or 1 (or -2, -1), got {axis!r}")
    if check_finite is not False:
        checks.flag("quantize_int8", "check_finite", check_finite)
        ops.check_finite_rows("quantize_int8", "weight", weight if axis in (1, -1) else weight.t())
    if axis in (0, -2):
        q, scale = quantize_int8_perrow(weight.t())  # q (N, K) row-major
        return q.t(), scale  # (K, N) column-major
    return quantize_int8_perrow(weight)


def matmul_int8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 GEMM: ``(a @ b) * a_scale[:, None] * b_scale[None, :] (+ bias)``.

    The int8 products are summed exactly in int32 on the tensor cores (a K longer than 131071 is
    split and the int32 partials summed in int64), then scaled in float32 in that order, the bias
    added in float32, and the result cast once to the output dtype.

    Args:
        a: (M, K) int8; row-major is fastest.
        a_scale: (M,) float16, bfloat16 or float32; its dtype is the output dtype.
        b: (K, N) int8; column-major (``b.stride() == (1, K)``, what :func:`quantize_int8` returns)
            is fastest, any strides work.
        b_scale: (N,) float16, bfloat16 or float32.
        out: optional (M, N) float16/bfloat16/float32 tensor to write into (its dtype wins).
        bias: optional (N,) float16, bfloat16 or float32.

    Returns:
        (M, N) in ``a_scale.dtype``, or ``out``.

    Raises:
        TypeError: a wrong dtype (``a``/``b`` not int8, scales, bias or ``out`` not float).
        ValueError: wrong dimensions, K mismatch, scale/bias/``out`` lengths or shapes, devices
            that differ.
        RuntimeError: grad mode is on and a scale or the bias requires grad (inference-only).
    """
    checks.tensors(
        "matmul_int8",
        ("out", "bias"),
        a=a,
        a_scale=a_scale,
        b=b,
        b_scale=b_scale,
        out=out,
        bias=bias,
    )
    if wants_grad(a_scale, b_scale, bias, out):
        raise ops.inference_only_error("matmul_int8")
    try:
        if out is None:
            return call_below_autograd(ops.int8_matmul, a, a_scale, b, b_scale, bias)
        call_below_autograd(ops.int8_matmul_out, a, a_scale, b, b_scale, bias, out)
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "matmul_int8") from None
    return out


def matmul_quantize_int8(
    fpa: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    check_finite: bool = False,
) -> torch.Tensor:
    """Quantize the rows of ``fpa`` per token, then :func:`matmul_int8`.

    Args:
        fpa: the floating-point ``a`` (hence the name): :func:`matmul_int8`'s left operand
            before quantization, (..., K) float16, bfloat16 or float32 activations; leading
            dimensions are flattened into M = prod(...) rows (a 1-D ``fpa`` is one row).
        b: (K, N) int8, column-major fastest (from ``quantize_int8(w, axis=0)``).
        b_scale: (N,) float16, bfloat16 or float32.
        out: optional (..., N) float tensor to write into; it must be viewable as (M, N).
        check_finite: keyword-only, default False; as :func:`quantize_int8_perrow`, per token.

    Returns:
        (..., N) in ``fpa.dtype`` (or ``out``).

    Raises:
        TypeError, ValueError: as :func:`quantize_int8_perrow` (``check_finite`` not a bool
            included) and :func:`matmul_int8`, for ``fpa`` of fewer than one dimension, and for
            ``out`` of the wrong shape.
        RuntimeError: grad mode is on and ``fpa`` requires grad (inference-only).
    """
    checks.tensors("matmul_quantize_int8", ("out",), fpa=fpa, b=b, b_scale=b_scale, out=out)
    if fpa.dim() < 1:
        raise ValueError("matmul_quantize_int8: `fpa` must have a last dimension K, got a scalar")
    if wants_grad(fpa):
        raise ops.inference_only_error("matmul_quantize_int8")
    k, lead = fpa.shape[-1], fpa.shape[:-1]
    rows = fpa.reshape(math.prod(lead), k)  # (M, K)
    if check_finite is not False:
        checks.flag("matmul_quantize_int8", "check_finite", check_finite)
        ops.check_finite_rows("matmul_quantize_int8", "fpa", rows)
    try:
        return _matmul_quantize(rows, lead, b, b_scale, out)
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "matmul_quantize_int8", x="fpa") from None


def _matmul_quantize(
    rows: torch.Tensor,
    lead: tuple[int, ...],
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``matmul_quantize_int8`` past its own checks, on ``fpa`` as (M, K) ``rows``."""
    q, scale = quantize_int8_perrow(rows)  # (M, K), (M,)
    if out is None:
        result = matmul_int8(q, scale, b, b_scale)  # (M, N)
        return result.reshape(*lead, result.shape[1])
    if b.dim() != 2:
        ops.check_matmul_inputs(q, scale, b, b_scale, None)  # raises, naming `b`
    n = b.shape[1]
    if out.shape != (*lead, n):
        raise ValueError(
            f"matmul_quantize_int8: `out` must have shape {(*lead, n)}, got {tuple(out.shape)}"
        )
    try:
        out2d = out.view(rows.shape[0], n)  # (M, N) sharing out's storage; -1 fails at N = 0
    except RuntimeError as error:
        raise ValueError(
            f"matmul_quantize_int8: `out` must be viewable as (M, N); strides {out.stride()}"
        ) from error
    matmul_int8(q, scale, b, b_scale, out=out2d)
    return out
