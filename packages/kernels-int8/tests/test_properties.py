"""Property tests (issue 49) for the kernels ``quantize_model``'s layers run:
``rms_norm_quantize_int8`` (the norms), ``silu_mul_quantize_int8`` (the MLP),
``quantize_int8_perrow`` (the weights, and activations called alone), ``matmul_int8`` (each
``Int8Linear.forward_quantized``) and ``matmul_quantize_int8`` (``Int8Linear.forward``).

For any input each returns what an independent float64 reference computes, or raises a
``ValueError``/``TypeError`` naming one of its arguments, or a ``RuntimeError`` naming the
unsupported operation (inference-only); nothing else, and the inputs (but ``out``) are left as
they were (``llmsys_dev.properties.outcome``). Inputs: tiny shapes (empty dims, one element, odd
sizes), every dtype, transposed, sliced and expanded views, NaN and Inf, inputs that require
grad; and for one argument at a time something broken on purpose, which must be refused.

The quantization contract checked: a row holding a NaN or Inf gets a NaN scale and zeros; else
``scale = max|row| / 127`` in the row's dtype and ``q = round(row / scale)`` (by the returned
scale) clamped to [-127, 127], within one step, or a few where the row itself (a norm's or the
SiLU's output) is computed in float32 and rounded. The Triton kernels run under the
interpreter: sizes stay at 16 and below and the example budgets keep this file near 30 s.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given
from hypothesis import strategies as st

from llmsys.kernels_int8 import (
    matmul_int8,
    matmul_quantize_int8,
    quantize_int8_perrow,
    rms_norm_quantize_int8,
    silu_mul_quantize_int8,
)
from llmsys_dev.properties import (
    Refused,
    assert_close,
    bad_dtypes,
    broken_tensor,
    outcome,
    property_settings,
    shapes,
    tensor,
    ulp,
)

# numpy's warnings from the interpreter, in lanes past the end and in rows of no columns.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]

FLOAT = (torch.float16, torch.bfloat16, torch.float32)
BAD_FLOAT = bad_dtypes(FLOAT)
BAD_INT8 = bad_dtypes((torch.int8,))


def check(result, broken):
    """The verdict common to every property: a broken argument is refused, a valid call
    returns. (``outcome`` already checked what a refusal says.)"""
    event("refused" if isinstance(result, Refused) else "returned")
    if broken is not None:
        assert isinstance(result, Refused), f"accepted a bad `{broken}`"
        return False
    assert not isinstance(result, Refused), result
    return True


def assert_quantized(q, scale, rows, dtype, row_rtol: float = 0.0) -> None:
    """``q`` (M, K) int8 and ``scale`` (M,) against ``rows`` (M, K): the float64 values that were
    quantized, already rounded to ``dtype`` (so an overflow is an Inf), each within ``row_rtol``
    of what the kernel computed."""
    m, k = rows.shape
    assert q.shape == (m, k) and q.dtype == torch.int8 and q.is_contiguous()
    assert scale.shape == (m,) and scale.dtype == dtype
    finite = rows.isfinite().all(dim=1)  # (M,)
    assert bool(scale[~finite].isnan().all()), scale
    assert bool((q[~finite] == 0).all())
    rows, got_scale = rows[finite], scale[finite].double()
    amax = rows.abs().amax(dim=1) if k else rows.new_zeros(rows.shape[0])
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    assert_close(got_scale, (amax / 127).to(dtype), row_rtol + ulp(dtype), 2 * tiny)
    nonzero = got_scale[:, None] > 0
    expected_q = torch.where(nonzero, (rows / got_scale[:, None]).round().clamp(-127, 127), 0.0)
    slack = 1 + math.ceil(127 * row_rtol)
    if rows.numel():
        assert float((q[finite].double() - expected_q).abs().max()) <= slack, (q, expected_q)


# --- quantize_int8_perrow ------------------------------------------------------------------------


@property_settings(80)
@given(data=st.data())
def test_quantize_int8_perrow(data):
    draw = data.draw
    m, k = draw(st.sampled_from([0, 1, 3, 8])), draw(st.sampled_from([0, 1, 5, 16]))
    dtype = draw(st.sampled_from(FLOAT))
    broken = draw(st.sampled_from([None, None, None, "x", "check_finite"]))
    if broken == "x":
        x = draw(
            broken_tensor((m, k), dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: len(s) != 2)
        )
    else:
        x = draw(tensor((m, k), dtype))
    check_finite = draw(
        st.sampled_from(["no", None, 1] if broken == "check_finite" else [False, False, True])
    )
    if check_finite is True and broken is None and x.numel() and not bool(x.isfinite().all()):
        broken = "x"  # refused, naming the row
    result = outcome(quantize_int8_perrow, x, check_finite=check_finite)
    if check(result, broken):
        assert_quantized(*result, x.double(), dtype)


# --- silu_mul_quantize_int8 ----------------------------------------------------------------------


@property_settings(80)
@given(data=st.data())
def test_silu_mul_quantize_int8(data):
    draw = data.draw
    shape = (*draw(shapes(max_dims=1)), draw(st.sampled_from([0, 1, 3, 16])))
    dtype = draw(st.sampled_from(FLOAT))
    broken = draw(st.sampled_from([None, None, None, "gate", "up"]))
    if broken == "gate":  # a 0-d gate, or up's shape differing from it
        gate = draw(
            broken_tensor(shape, dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != shape)
        )
    else:
        gate = draw(tensor(shape, dtype))
    if broken == "up":
        up = draw(broken_tensor(shape, dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != shape))
    else:
        up = draw(tensor(shape, dtype))
    if isinstance(gate, torch.Tensor) and gate.dim() == 0 and isinstance(up, torch.Tensor):
        broken = broken or "gate"
    result = outcome(silu_mul_quantize_int8, gate, up)
    if check(result, broken):
        silu = F.silu(gate.double()).to(dtype).double()  # rounded, as eager rounds it
        rows = (silu * up.double()).to(dtype).double().reshape(math.prod(shape[:-1]), shape[-1])
        assert_quantized(*result, rows, dtype, row_rtol=2 * ulp(dtype))


# --- rms_norm_quantize_int8 ----------------------------------------------------------------------


@property_settings(80)
@given(data=st.data())
def test_rms_norm_quantize_int8(data):
    draw = data.draw
    lead, n = draw(shapes(max_dims=2)), draw(st.sampled_from([1, 3, 8, 16, 0]))
    shape = (*lead, n)
    dtype = draw(st.sampled_from(FLOAT))
    w_dtype = draw(st.sampled_from([dtype, dtype, torch.float32]))
    broken = draw(st.sampled_from([None, None, None, "x", "weight", "eps", "residual"]))
    if broken == "x":
        x = draw(
            broken_tensor(shape, dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s[-1:] != (n,))
        )
    else:
        x = draw(tensor(shape, dtype))
    if broken == "weight":
        weight = draw(
            broken_tensor((n,), w_dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != (n,))
        )
    else:
        weight = draw(tensor((n,), w_dtype))
    if broken == "eps":
        eps = draw(st.sampled_from([-1e-6, math.nan, math.inf, "1e-6", None, True]))
    else:
        eps = draw(st.sampled_from([1e-6, 1e-5, 0.0, 0.5, 1]))
    if broken == "residual":
        residual = draw(
            broken_tensor(shape, dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != shape)
        )
    else:
        residual = draw(st.none() | tensor(shape, draw(st.sampled_from(FLOAT))))
    if draw(st.booleans()) and isinstance(x, torch.Tensor) and x.is_floating_point():
        x = x.detach().requires_grad_()  # forward only: the outputs carry no gradient
    result = outcome(rms_norm_quantize_int8, x, weight, eps, residual)
    if not check(result, broken):
        return
    x = x.detach()
    s = x if residual is None else (x.double() + residual.double()).to(dtype)
    s64 = s.double()
    y_dtype = torch.promote_types(dtype, weight.dtype)
    y = weight.double() * (s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + float(eps)))
    rows = y.to(y_dtype).double().reshape(math.prod(lead), n)
    assert_quantized(*result[:2], rows, y_dtype, row_rtol=2 * (ulp(dtype) + ulp(y_dtype)))
    assert not result[1].requires_grad
    if residual is not None:
        assert result[2].shape == shape and result[2].dtype == dtype
        assert_close(result[2], s.double(), ulp(dtype), 0.0)


# --- matmul_int8 and matmul_quantize_int8 ---------------------------------------------------------


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    """NaN at the same places, equal infinities, else ``|got - expected| <= bound``."""
    got, expected = got.double(), expected.double()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert torch.equal(got.isnan(), expected.isnan()), (got, expected)
    inf = expected.isinf()
    assert torch.equal(got[inf], expected[inf]), (got, expected)
    ok = (got - expected).abs() <= bound
    ok |= expected.isnan() | inf
    assert bool(ok.all()), (got, expected, bound)


def scaled_product(q, q_scale, b, b_scale, bias, out_dtype):
    """``(q @ b) * q_scale * b_scale (+ bias)`` in float64, rounded to ``out_dtype``, and the
    bound of its error: float32's epilogue, then one rounding to ``out_dtype``."""
    product = (q.double() @ b.double()) * q_scale.double()[:, None] * b_scale.double()
    if bias is not None:
        product = product + bias.double()
    rtol = 4 * torch.finfo(torch.float32).eps + ulp(out_dtype)
    magnitude = (q.double().abs() @ b.double().abs()) * (
        q_scale.double()[:, None] * b_scale.double()
    ).abs()
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return product.to(out_dtype), rtol * magnitude.nan_to_num(0.0, 0.0, 0.0)


@property_settings(80)
@given(data=st.data())
def test_matmul_int8(data):
    draw = data.draw
    m, k, n = (draw(st.sampled_from([0, 1, 3, 16])) for _ in range(3))
    scale_dtype, b_scale_dtype = draw(st.sampled_from(FLOAT)), draw(st.sampled_from(FLOAT))
    broken = draw(
        st.sampled_from([None] * 4 + ["a", "a_scale", "b", "b_scale", "out", "bias", "grad"])
    )
    ints = (-128, 128)
    a = (
        draw(
            broken_tensor((m, k), torch.int8, bad_dtypes=BAD_INT8, bad_shape=lambda s: len(s) != 2)
        )
        if broken == "a"
        else draw(tensor((m, k), torch.int8, ints=ints))
    )
    b = (
        draw(
            broken_tensor(
                (k, n),
                torch.int8,
                bad_dtypes=BAD_INT8,
                bad_shape=lambda s: len(s) != 2 or s[0] != k,
            )
        )
        if broken == "b"
        else draw(tensor((k, n), torch.int8, ints=ints))
    )
    a_scale = (
        draw(broken_tensor((m,), scale_dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != (m,)))
        if broken == "a_scale"
        else draw(tensor((m,), scale_dtype))
    )
    b_scale = (
        draw(
            broken_tensor((n,), b_scale_dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != (n,))
        )
        if broken == "b_scale"
        else draw(tensor((n,), b_scale_dtype))
    )
    bias_dtype, out_dtype = draw(st.sampled_from(FLOAT)), draw(st.sampled_from(FLOAT))
    if broken == "bias":
        bias = draw(
            broken_tensor((n,), bias_dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != (n,))
        )
    else:
        bias = draw(st.none() | tensor((n,), bias_dtype))
    if broken == "out":
        out = draw(
            broken_tensor((m, n), out_dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != (m, n))
        )
    else:
        out = draw(st.none() | tensor((m, n), out_dtype).filter(lambda t: t.stride(0) or m < 2))
    if broken == "grad":  # a scale that requires grad: inference-only
        a_scale = a_scale.detach().requires_grad_()
    result = outcome(matmul_int8, a, a_scale, b, b_scale, out, bias, may_write=("out",))
    if not check(result, broken):
        return
    if out is not None:
        assert result is out
    out_dtype = scale_dtype if out is None else out.dtype
    assert result.shape == (m, n) and result.dtype == out_dtype
    expected, bound = scaled_product(a, a_scale, b, b_scale, bias, out_dtype)
    assert_within(result, expected, bound)


def quantize_64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row quantization in float64: ``scale = max|row| / 127`` rounded to x's dtype, NaN for
    a row holding a NaN or Inf; ``q = round(row / scale)``, 0 where the scale is 0 or NaN."""
    x64 = x.double()
    amax = x64.abs().amax(dim=1) if x.shape[1] else x64.new_zeros(x.shape[0])
    scale = torch.where(x64.isfinite().all(dim=1), amax / 127, math.nan).to(x.dtype).double()
    ok = (scale > 0)[:, None]
    q = torch.where(ok, (x64 / torch.where(ok, scale[:, None], 1.0)).round().clamp(-127, 127), 0.0)
    return q, scale


@property_settings(80)
@given(data=st.data())
def test_matmul_quantize_int8(data):
    draw = data.draw
    lead = draw(shapes(max_dims=2))
    k, n = draw(st.sampled_from([0, 1, 3, 16])), draw(st.sampled_from([0, 1, 5, 16]))
    dtype, b_scale_dtype = draw(st.sampled_from(FLOAT)), draw(st.sampled_from(FLOAT))
    broken = draw(
        st.sampled_from([None] * 4 + ["fpa", "b", "b_scale", "out", "check_finite", "grad"])
    )
    if broken == "fpa":
        fpa = draw(
            broken_tensor(
                (*lead, k), dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s[-1:] != (k,)
            )
        )
    else:
        fpa = draw(tensor((*lead, k), dtype))
    b = (
        draw(
            broken_tensor(
                (k, n),
                torch.int8,
                bad_dtypes=BAD_INT8,
                bad_shape=lambda s: len(s) != 2 or s[0] != k,
            )
        )
        if broken == "b"
        else draw(tensor((k, n), torch.int8, ints=(-127, 128)))
    )
    b_scale = (
        draw(
            broken_tensor((n,), b_scale_dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != (n,))
        )
        if broken == "b_scale"
        else draw(tensor((n,), b_scale_dtype))
    )
    out_shape = (*lead, n)
    if broken == "out":
        out = draw(
            broken_tensor(
                out_shape, dtype, bad_dtypes=BAD_FLOAT, bad_shape=lambda s: s != out_shape
            )
        )
    else:
        out = draw(st.none() | tensor(out_shape, draw(st.sampled_from(FLOAT)), plain=True))
    check_finite = draw(
        st.sampled_from(["yes", None, 0] if broken == "check_finite" else [False, False, True])
    )
    if broken == "grad":
        fpa = fpa.detach().requires_grad_()  # inference-only
    elif check_finite is True and broken is None and fpa.numel() and not fpa.isfinite().all():
        broken = "fpa"  # refused, naming the row
    result = outcome(
        matmul_quantize_int8, fpa, b, b_scale, out, check_finite=check_finite, may_write=("out",)
    )
    if not check(result, broken):
        return
    if out is not None:
        assert result is out
    out_dtype = dtype if out is None else out.dtype
    assert result.shape == out_shape and result.dtype == out_dtype
    q, scale = quantize_64(fpa.detach().reshape(math.prod(lead), k))
    expected, bound = scaled_product(q, scale, b, b_scale, None, out_dtype)
    # the kernel's q may be one step off the float64 one (a quotient near a half): one step of
    # each product, plus the float32 epilogue's bound
    steps = scale[:, None] * (b.double().abs().sum(0) * b_scale.double().abs())
    assert_within(
        result.reshape(math.prod(lead), n), expected, bound + steps.nan_to_num(0.0, 0.0, 0.0)
    )


# --- what the properties found (issue 49), as plain regression tests ------------------------------


def test_rms_norm_quantize_reads_a_strided_weight_through_its_strides():
    """A weight with a stride was read as if contiguous (the kernel takes no weight stride)."""
    x, weight = torch.randn(3, 8), torch.randn(16)[::2]
    for got, expected in zip(
        rms_norm_quantize_int8(x, weight),
        rms_norm_quantize_int8(x, weight.contiguous()),
        strict=True,
    ):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("lead", [(), (3,), (0,)])
def test_matmul_quantize_int8_writes_an_out_of_no_columns(lead):
    """``out`` of N = 0 columns was refused as "not viewable as (M, N)" (``view(-1, 0)``)."""
    fpa, b, b_scale = torch.randn(*lead, 4), torch.ones(4, 0, dtype=torch.int8), torch.ones(0)
    out = torch.empty(*lead, 0)
    assert matmul_quantize_int8(fpa, b, b_scale, out) is out


def test_quantize_int8_perrow_check_finite_refuses_a_0d_x_naming_it():
    """``check_finite=True`` on a 0-d ``x`` was an ``IndexError`` from the finiteness check."""
    with pytest.raises(ValueError, match="`x` must be 2-D"):
        quantize_int8_perrow(torch.tensor(1.0), check_finite=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_matmul_quantize_int8_names_fpa_for_its_dtype(dtype):
    """A float64 or integer ``fpa`` was refused naming the quantizer's ``x``."""
    b, b_scale = torch.ones(4, 2, dtype=torch.int8), torch.ones(2)
    with pytest.raises(TypeError, match="`fpa` must have dtype"):
        matmul_quantize_int8(torch.ones(3, 4, dtype=dtype), b, b_scale)
