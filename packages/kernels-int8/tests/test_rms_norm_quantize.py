"""Tests for rms_norm_quantize_int8 (llmsys.kernels_int8.rms_norm_quantize): against quantizing
llmsys.kernels_fused's rms_norm output, zero and non-finite rows, the op by name, bad input.

On a CPU-only machine the kernel runs under Triton's interpreter, where a float32 -> bfloat16 cast
truncates instead of rounding to nearest even: bit-exact bfloat16 checks are in
test_rms_norm_quantize_gpu.py.
"""

import importlib
import math
import re

import pytest
import torch

from llmsys.kernels_fused import rms_norm, rms_norm_reference
from llmsys.kernels_int8 import (
    quantize_int8_perrow_reference,
    rms_norm_quantize_int8,
    rms_norm_quantize_int8_reference,
)

# numpy's warnings from the interpreter: 0 / 0 and 1 / sqrt(0) in lanes and rows past the end,
# and in rows of no columns, whose results are never stored.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning"),
]

# The launch policy the kernel shares with rms_norm (the path fixture patches it).
norm_module = importlib.import_module("llmsys.kernels_fused.rms_norm")
quantize_op = torch.ops.llmsys.int8_rms_norm_quantize

# bfloat16 rounding differs under the interpreter: its bit-exact checks are GPU tests.
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float16)]
# (leading shape, N): odd N, one row, odd row counts, 3-D input, no rows, empty rows.
SIZES = [((1,), 1), ((5,), 7), ((3,), 33), ((7,), 130), ((2, 3), 33), ((0,), 33), ((4,), 0)]
FORCED_PATHS = ["row_per_program", "chunked"]
PATH_SIZES = [((1,), 1), ((7,), 130), ((2, 3), 33)]


def cases():
    """(size, dtypes, path): every size on the default path, PATH_SIZES on the forced ones."""
    default = [(size, pair, "one_pass") for size in SIZES for pair in DTYPE_PAIRS]
    forced = [(s, pair, p) for p in FORCED_PATHS for s in PATH_SIZES for pair in DTYPE_PAIRS]
    return [
        pytest.param(size, pair, p, id=f"{p}-{size}-{pair[0]}".replace(" ", ""))
        for size, pair, p in default + forced
    ]


@pytest.fixture
def path(request, monkeypatch) -> str:
    """Forces a path: rows kept in registers several to a program (the default at these sizes),
    one row per program, or rows walked in chunks of 16 (the path of N > MAX_BLOCK_N)."""
    if request.param == "row_per_program":
        monkeypatch.setattr(norm_module, "ROW_BLOCK_ELEMENTS", 1)
    if request.param == "chunked":
        monkeypatch.setattr(norm_module, "MAX_BLOCK_N", 16)
    return request.param


def rand(shape, dtype, device, scale: float = 2.0) -> torch.Tensor:
    return (scale * torch.randn(shape, device=device) + 0.5).to(dtype)


def inputs(size, dtype, device, weight_dtype=None, residual=False):
    lead, n = size
    x = rand((*lead, n), dtype, device)
    weight = rand((n,), weight_dtype or dtype, device, scale=1.0)
    r = rand((*lead, n), dtype, device) if residual else None
    return x, weight, r


def rows(x) -> int:
    return math.prod(x.shape[:-1])


def quantize_our_rms_norm(x, weight, eps, r):
    y = rms_norm(x, weight, eps, r)
    y = y[0] if r is not None else y
    return quantize_int8_perrow_reference(y.reshape(rows(x), x.shape[-1]))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("size", "dtypes", "path"), cases(), indirect=["path"])
def test_equals_quantizing_rms_norm_bit_for_bit(
    size, dtypes, residual, path, device, poisoned_allocations
):
    dtype, weight_dtype = dtypes
    x, weight, r = inputs(size, dtype, device, weight_dtype, residual)
    out = rms_norm_quantize_int8(x, weight, 1e-6, r)
    q, scale = quantize_our_rms_norm(x, weight, 1e-6, r)
    assert out[0].shape == (rows(x), x.shape[-1]) and out[0].is_contiguous()
    assert torch.equal(out[0], q) and torch.equal(out[1], scale)
    if residual:
        assert torch.equal(out[2], rms_norm_reference(x, weight, 1e-6, r)[1])
    # and against the composed eager reference: the same up to rms_norm's last-bit differences
    q_ref, scale_ref, *_ = rms_norm_quantize_int8_reference(x, weight, 1e-6, r)
    torch.testing.assert_close(
        out[1], scale_ref, rtol=2e-3 if dtype != torch.float32 else 1e-6, atol=0
    )
    assert (out[0].int() - q_ref.int()).abs().max().item() <= 1 if q_ref.numel() else True


def test_float32_matches_the_composed_reference(device):
    # float32 rms_norm agrees with eager to the last bits; their quantized rows agree exactly
    # wherever no value sits within those bits of a rounding boundary.
    x, weight, _ = inputs(((11,), 33), torch.float32, device)
    q, scale = rms_norm_quantize_int8(x, weight)
    q_ref, scale_ref = rms_norm_quantize_int8_reference(x, weight)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    assert (q != q_ref).float().mean().item() < 0.02


@pytest.mark.parametrize("path", ["one_pass", *FORCED_PATHS], indirect=True)
def test_zero_and_non_finite_rows(path, device, poisoned_allocations):
    x, weight, _ = inputs(((6,), 33), torch.float32, device)
    x[1] = 0.0
    x[3, 20] = float("inf")
    x[4, 5] = float("nan")
    q, scale = rms_norm_quantize_int8(x, weight)
    assert scale[1] == 0 and (q[1] == 0).all()
    assert scale[[3, 4]].isnan().all() and (q[[3, 4]] == 0).all()
    finite = [0, 1, 2, 5]
    q_ref, scale_ref = quantize_our_rms_norm(x[finite], weight, 1e-6, None)
    assert torch.equal(q[finite], q_ref) and torch.equal(scale[finite], scale_ref)


def test_3d_input_flattens_rows(device):
    x, weight, r = inputs(((2, 3), 7), torch.bfloat16, device, residual=True)
    q, scale, s = rms_norm_quantize_int8(x, weight, residual=r)
    assert q.shape == (6, 7) and scale.shape == (6,) and scale.dtype == torch.bfloat16
    assert s.shape == (2, 3, 7)


def test_ignores_requires_grad(device):
    x, weight, _ = inputs(((3,), 7), torch.float32, device)
    q, scale = rms_norm_quantize_int8(x.requires_grad_(), weight.requires_grad_())
    assert not scale.requires_grad and q.dtype == torch.int8


def test_inputs_are_left_untouched(device):
    x, weight, r = inputs(((5,), 7), torch.bfloat16, device, residual=True)
    copies = [t.clone() for t in (x, weight, r)]
    rms_norm_quantize_int8(x, weight, residual=r)
    assert all(torch.equal(t, c) for t, c in zip((x, weight, r), copies, strict=True))


def test_kernels_fused_no_longer_holds_the_int8_norm():
    # It moved here; kernels-fused keeps no alias (that would import this package, which
    # imports kernels-fused).
    import llmsys.kernels_fused as fused

    assert not hasattr(fused, "rms_norm_quantize_int8")
    assert not hasattr(fused, "rms_norm_quantize_int8_reference")


# --- bad input -----------------------------------------------------------------------------------

GOOD = {"x": ((5, 8), torch.float32), "weight": ((8,), torch.float32)}

BAD_CASES = [
    # (what changes, expected error, message fragment)
    ({"x": [1.0, 2.0]}, TypeError, "`x` must be a torch.Tensor, got list"),
    ({"x": ((5, 8), torch.int32)}, TypeError, "`x` must have dtype in (float16, bfloat16, "),
    ({"x": ((), torch.float32)}, ValueError, "`x` must have at least one dimension"),
    ({"weight": ((8,), torch.int8)}, TypeError, "`weight` must have dtype in"),
    ({"weight": ((7,), torch.float32)}, ValueError, "`weight` must have shape (8,)"),
    ({"eps": "1e-6"}, TypeError, "`eps` must be a float, got str"),
    ({"eps": -1e-6}, ValueError, "`eps` must be finite and at least 0, got -1e-06"),
    ({"residual": ((5, 8), torch.int32)}, TypeError, "`residual` must have dtype in"),
    ({"residual": ((5, 7), torch.float32)}, ValueError, "`residual` must have the shape of `x`"),
]


def bad_arguments(change, device):
    args = {"x": GOOD["x"], "weight": GOOD["weight"], "eps": 1e-6, "residual": None, **change}
    for name in ("x", "weight", "residual"):
        if isinstance(args[name], tuple):
            args[name] = rand(*args[name], device)
    return args


@pytest.mark.parametrize(("change", "error", "message"), BAD_CASES)
def test_bad_input_raises_naming_the_argument(change, error, message, device):
    with pytest.raises(error, match=r"^rms_norm_quantize_int8: .*" + re.escape(message)):
        rms_norm_quantize_int8(**bad_arguments(change, device))


# The op's schema checks argument types first (a RuntimeError naming none): tensor cases only.
TENSOR_CASES = [c for c in BAD_CASES if all(isinstance(v, tuple) for v in c[0].values())]


@pytest.mark.parametrize(("change", "error", "message"), TENSOR_CASES)
def test_op_by_name_raises_naming_the_argument(change, error, message, device):
    args = bad_arguments(change, device)
    with pytest.raises(error, match=r"^int8_rms_norm_quantize: .*" + re.escape(message)):
        quantize_op(args["x"], args["weight"], args["eps"], args["residual"])


# --- compile, opcheck ----------------------------------------------------------------------------


def test_compile_fullgraph(device):
    compiled = torch.compile(rms_norm_quantize_int8, fullgraph=True, backend="aot_eager")
    x, weight, r = inputs(((2, 3), 33), torch.float32, device, residual=True)
    got, expected = compiled(x, weight, 1e-6, r), rms_norm_quantize_int8(x, weight, 1e-6, r)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_opcheck(residual, device):
    x, weight, r = inputs(((5,), 33), torch.float32, device, residual=residual)
    torch.library.opcheck(quantize_op.default, (x, weight, 1e-6, r))
