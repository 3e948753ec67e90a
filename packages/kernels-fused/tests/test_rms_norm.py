"""Tests for RMSNorm (llmsys.kernels_fused.rms_norm): forward, backward, the registered ops, the
module, bad input. (The int8 variant is tested in kernels-int8.)

Accuracy is measured against a float64 evaluation of the same formula: our error is at most twice
eager PyTorch's in the same dtypes (plus a floor of one ulp for ties). On a CPU-only
machine the kernels run under Triton's interpreter, where a float32 -> bfloat16 cast truncates
instead of rounding to nearest even: bit-exact bfloat16 checks are in test_rms_norm_gpu.py.
"""

import importlib
import re

import pytest
import torch

from llmsys.kernels_fused import (
    LlamaStyleRMSNorm,
    RMSNorm,
    rms_norm,
    rms_norm_backward_reference,
    rms_norm_reference,
)
from llmsys_dev.device import ON_GPU

# numpy's warnings from the interpreter: 0 / 0 and 1 / sqrt(0) in lanes and rows past the end,
# and in rows of no columns, whose results are never stored.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning"),
]

# The module (the package's `rms_norm` attribute is the function of that name).
rms_module = importlib.import_module("llmsys.kernels_fused.rms_norm")
fwd_op = torch.ops.llmsys_fused.rms_norm_fwd
bwd_op = torch.ops.llmsys_fused.rms_norm_bwd

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (x dtype, weight dtype): each dtype alone, and bfloat16 activations with a float32 weight (the
# autocast case, whose output is float32).
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
]
# (leading shape, N): odd N, one row, odd row counts, 3-D input, no rows, empty rows.
SIZES = [((1,), 1), ((5,), 7), ((3,), 33), ((7,), 130), ((2, 3), 33), ((0,), 33), ((4,), 0)]
# The dispatch paths a small size takes only when forced (the `path` fixture), on fewer sizes.
FORCED_PATHS = ["row_per_program", "chunked"]
PATH_SIZES = [((1,), 1), ((7,), 130), ((2, 3), 33)]


def size_id(size) -> str:
    lead, n = size
    return "x".join(map(str, lead)) + f"-{n}"


def pair_id(pair) -> str:
    return "-".join(str(d).removeprefix("torch.") for d in pair)


def cases(pairs):
    """(size, dtypes, path): every size on the default path, PATH_SIZES on the forced ones."""
    default = [(size, pair, "one_pass") for size in SIZES for pair in pairs]
    forced = [(size, pair, p) for p in FORCED_PATHS for size in PATH_SIZES for pair in pairs]
    return [
        pytest.param(size, pair, p, id=f"{p}-{size_id(size)}-{pair_id(pair)}")
        for size, pair, p in default + forced
    ]


@pytest.fixture
def path(request, monkeypatch) -> str:
    """Forces a dispatch path: rows kept in registers with several rows per program (the default
    at these sizes), one row per program (several row blocks per backward program), or rows
    walked in chunks of 16 (the path of N > MAX_BLOCK_N)."""
    if request.param == "row_per_program":
        monkeypatch.setattr(rms_module, "ROW_BLOCK_ELEMENTS", 1)
    if request.param == "chunked":
        monkeypatch.setattr(rms_module, "MAX_BLOCK_N", 16)
        monkeypatch.setattr(rms_module, "MAX_BLOCK_N_BWD", 16)
    return request.param


def rand(shape, dtype, device, scale: float = 2.0) -> torch.Tensor:
    return (scale * torch.randn(shape, device=device) + 0.5).to(dtype)


def inputs(size, dtype, device, weight_dtype=None, residual=False):
    lead, n = size
    x = rand((*lead, n), dtype, device)
    weight = rand((n,), weight_dtype or dtype, device, scale=1.0)
    r = rand((*lead, n), dtype, device) if residual else None
    return x, weight, r


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def kernel_runs(device) -> bool:
    """False on CPU without TRITON_INTERPRET=1, where the ops run the eager reference."""
    return device == "cuda" or rms_module.CPU_RUNS_TRITON


def exact_bits_here(dtype) -> bool:
    """The interpreter truncates float32 -> bfloat16; every other cast rounds as eager does."""
    return dtype != torch.bfloat16 or ON_GPU


def assert_twice_eager(ours, eager, exact, rounding_dtype, name="") -> None:
    """max|ours - exact| <= 2 max|eager - exact| + a floor for ties: one ulp of
    ``rounding_dtype`` (the narrowest dtype the computation rounds to) at the largest value
    (eager can be exact by luck where a correctly rounded result is half an ulp off).

    Under the interpreter a bfloat16 rounding truncates (up to 1 ulp, not half), and rms_norm
    rounds twice (the normalised value, then y): the floor there is 2 ulps.
    """
    assert ours.shape == eager.shape and ours.dtype == eager.dtype, name
    if ours.numel() == 0:
        return
    exact = exact.double()
    err_ours = (ours.double() - exact).abs().max().item()
    err_eager = (eager.double() - exact).abs().max().item()
    ulps = 1.0 if exact_bits_here(rounding_dtype) else 2.0
    floor = ulps * torch.finfo(rounding_dtype).eps * exact.abs().max().item()
    assert err_ours <= 2 * err_eager + floor, f"{name}: ours {err_ours:.3g}, eager {err_eager:.3g}"


def narrowest(*dtypes) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def float64(*tensors):
    return tuple(None if t is None else t.double() for t in tensors)


# --- forward -------------------------------------------------------------------------------------


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("size", "dtypes", "path"), cases(DTYPE_PAIRS), indirect=["path"])
def test_forward_within_twice_eager_error(
    size, dtypes, residual, path, device, poisoned_allocations
):
    dtype, weight_dtype = dtypes
    x, weight, r = inputs(size, dtype, device, weight_dtype, residual)
    ours = as_tuple(rms_norm(x, weight, 1e-6, r))
    eager = as_tuple(rms_norm_reference(x, weight, 1e-6, r))
    exact = as_tuple(rms_norm_reference(*float64(x, weight), 1e-6, *float64(r)))
    assert ours[0].dtype == torch.promote_types(dtype, weight.dtype)
    assert_twice_eager(ours[0], eager[0], exact[0], narrowest(dtype, weight.dtype), "y")
    if residual:
        if exact_bits_here(dtype):
            assert torch.equal(ours[1], eager[1])  # s = x + residual, rounded as eager rounds
        else:
            assert_twice_eager(ours[1], eager[1], exact[1], dtype, "s")


def test_float32_matches_eager_closely(device):
    x, weight, r = inputs(((9,), 130), torch.float32, device, residual=True)
    y, s = rms_norm(x, weight, residual=r)
    y_eager, s_eager = rms_norm_reference(x, weight, residual=r)
    torch.testing.assert_close(y, y_eager, rtol=2e-6, atol=1e-6)
    assert torch.equal(s, s_eager)


@pytest.mark.parametrize("eps", [0.0, 0.5, 3])
def test_eps_is_used(eps, device):
    x, weight, _ = inputs(((3,), 33), torch.float32, device)
    x = x / 10  # mean square well below 0.5, so eps matters
    torch.testing.assert_close(rms_norm(x, weight, eps), rms_norm_reference(x, weight, eps))


def test_non_contiguous_inputs_match_contiguous(device):
    x = rand((33, 12), torch.float32, device).t()  # (12, 33), transposed
    r = rand((12, 66), torch.float32, device)[:, ::2]  # (12, 33), sliced
    weight = rand((33,), torch.float32, device)
    y, s = rms_norm(x, weight, residual=r)
    y_c, s_c = rms_norm(x.contiguous(), weight, residual=r.contiguous())
    assert y.is_contiguous() and torch.equal(s, s_c)
    if kernel_runs(device):  # (eager sums a transposed row in another order)
        assert torch.equal(y, y_c)
    else:
        torch.testing.assert_close(y, y_c)


def test_nan_poison_reaches_outputs(monkeypatch, device, poisoned_allocations):
    # Guards the fixture: with the kernel launch removed, the outputs stay NaN.
    if not kernel_runs(device):
        pytest.skip("the eager fallback launches no kernel")
    monkeypatch.setattr(rms_module, "launch", lambda *args, **kwargs: None)
    x, weight, r = inputs(((3,), 7), torch.float32, device, residual=True)
    y, s = rms_norm(x, weight, residual=r)
    assert y.isnan().all() and s.isnan().all()


def test_inputs_are_left_untouched(device):
    x, weight, r = inputs(((5,), 7), torch.bfloat16, device, residual=True)
    copies = [t.clone() for t in (x, weight, r)]
    rms_norm(x, weight, residual=r)
    assert all(torch.equal(t, c) for t, c in zip((x, weight, r), copies, strict=True))


# --- backward ------------------------------------------------------------------------------------


def grads(fn, x, weight, r, grad_y, grad_s):
    """Gradients of x, weight (and residual) of ``fn`` for fresh leaves holding these values."""
    leaves = [t.detach().requires_grad_() for t in (x, weight, r) if t is not None]
    out = as_tuple(fn(leaves[0], leaves[1], 1e-6, leaves[2] if r is not None else None))
    outputs, cotangents = (out, (grad_y, grad_s)) if r is not None else (out, (grad_y,))
    return torch.autograd.grad(outputs, leaves, cotangents)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("size", "dtypes", "path"), cases(DTYPE_PAIRS), indirect=["path"])
def test_backward_within_twice_eager_error(
    size, dtypes, residual, path, device, poisoned_allocations
):
    dtype, weight_dtype = dtypes
    x, weight, r = inputs(size, dtype, device, weight_dtype, residual)
    out_dtype = torch.promote_types(dtype, weight.dtype)
    grad_y = rand(x.shape, out_dtype, device, scale=1.0)
    grad_s = rand(x.shape, dtype, device, scale=1.0) if residual else None
    ours = grads(rms_norm, x, weight, r, grad_y, grad_s)
    eager = grads(rms_norm_reference, x, weight, r, grad_y, grad_s)
    exact = grads(rms_norm_reference, *float64(x, weight, r, grad_y, grad_s))
    rounding = narrowest(dtype, weight.dtype)
    for name, o, e, ex in zip(["x", "weight", "residual"], ours, eager, exact, strict=False):
        assert_twice_eager(o, e, ex, rounding, name)
    if residual:
        assert torch.equal(ours[0], ours[2])  # x and residual receive the gradient of s


def test_backward_reference_matches_autograd_of_the_reference(device):
    x, weight, r = float64(*inputs(((2, 3), 33), torch.float32, device, residual=True))
    grad_y, grad_s = rand(x.shape, torch.float64, device), rand(x.shape, torch.float64, device)
    expected = grads(rms_norm_reference, x, weight, r, grad_y, grad_s)
    s = x + r
    rstd = torch.rsqrt(s.pow(2).mean(-1) + 1e-6).reshape(-1)
    dx, dweight = rms_norm_backward_reference(grad_y, grad_s, s, weight, rstd)
    torch.testing.assert_close((dx, dweight), (expected[0], expected[1]))


def test_only_s_used_passes_its_gradient_through(device):
    x, weight, r = (
        t.requires_grad_() for t in inputs(((3,), 7), torch.float32, device, residual=True)
    )
    _, s = rms_norm(x, weight, residual=r)
    grad_s = rand(s.shape, torch.float32, device)
    s.backward(grad_s)
    assert torch.equal(x.grad, grad_s) and torch.equal(r.grad, grad_s) and weight.grad is None


def test_only_y_used_with_residual(device):
    x, weight, r = inputs(((5,), 33), torch.float32, device, residual=True)
    grad_y = rand(x.shape, torch.float32, device)
    leaves = [t.detach().requires_grad_() for t in (x, weight, r)]
    got = torch.autograd.grad(rms_norm(*leaves[:2], residual=leaves[2])[0], leaves, grad_y)
    expected = grads(rms_norm_reference, x, weight, r, grad_y, torch.zeros_like(x))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("needs_grad", ["x", "weight"])
def test_gradient_for_one_input_only(needs_grad, device):
    x, weight, _ = inputs(((5,), 7), torch.float32, device)
    named = {"x": x, "weight": weight}
    named[needs_grad].requires_grad_()
    grad_y = rand(x.shape, torch.float32, device)
    rms_norm(x, weight).backward(grad_y)
    expected = dict(
        zip(named, grads(rms_norm_reference, x, weight, None, grad_y, None), strict=True)
    )
    torch.testing.assert_close(named[needs_grad].grad, expected[needs_grad])
    assert all(t.grad is None for name, t in named.items() if name != needs_grad)


def test_weight_gradient_is_deterministic(monkeypatch, device):
    monkeypatch.setattr(rms_module, "ROW_BLOCK_ELEMENTS", 1)  # 13 rows over the programs
    x, weight, _ = inputs(((13,), 33), torch.bfloat16, device, torch.float32)
    grad_y = rand(x.shape, torch.float32, device)
    first, second = (grads(rms_norm, x, weight, None, grad_y, None) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert first[1].dtype == torch.float32


def test_op_by_name_is_differentiable_like_rms_norm(device):
    x, weight, r = inputs(((3,), 33), torch.float32, device, residual=True)
    grad_y, grad_s = rand(x.shape, torch.float32, device), rand(x.shape, torch.float32, device)

    def by_name(x, weight, eps, residual):
        y, s, _rstd = fwd_op(x, weight, eps, residual)
        return y, s

    got = grads(by_name, x, weight, r, grad_y, grad_s)
    torch.testing.assert_close(got, grads(rms_norm, x, weight, r, grad_y, grad_s))


@pytest.mark.parametrize("call", ["rms_norm", "op_by_name"])
def test_double_backward_raises(call, device):
    x, weight, _ = (
        t.requires_grad_() if t is not None else t for t in inputs(((3,), 7), torch.float32, device)
    )
    y = rms_norm(x, weight) if call == "rms_norm" else fwd_op(x, weight, 1e-6, None)[0]
    with pytest.raises(RuntimeError, match="rms_norm: double backward is not supported"):
        torch.autograd.grad(y.sum(), (x, weight), create_graph=True)


# --- bad input -----------------------------------------------------------------------------------

GOOD = {"x": ((5, 8), torch.float32), "weight": ((8,), torch.float32)}


def make(shape, dtype, device):
    return rand(shape, dtype, device)


BAD_CASES = [
    # (what changes, expected error, message fragment)
    ({"x": [1.0, 2.0]}, TypeError, "`x` must be a torch.Tensor, got list"),
    (
        {"x": ((5, 8), torch.int32)},
        TypeError,
        "`x` must have dtype in (float16, bfloat16, float32)",
    ),
    ({"x": ((5, 8), torch.float64)}, TypeError, "`x` must have dtype in"),
    ({"x": ((), torch.float32)}, ValueError, "`x` must have at least one dimension"),
    ({"weight": None}, TypeError, "`weight` must be a torch.Tensor, got NoneType"),
    ({"weight": ((8,), torch.int8)}, TypeError, "`weight` must have dtype in"),
    ({"weight": ((7,), torch.float32)}, ValueError, "`weight` must have shape (8,)"),
    ({"weight": ((1, 8), torch.float32)}, ValueError, "got (1, 8)"),
    ({"eps": "1e-6"}, TypeError, "`eps` must be a float, got str"),
    ({"eps": None}, TypeError, "`eps` must be a float, got NoneType"),
    ({"eps": True}, TypeError, "`eps` must be a float, got bool"),
    ({"eps": -1e-6}, ValueError, "`eps` must be finite and at least 0, got -1e-06"),
    ({"eps": float("nan")}, ValueError, "`eps` must be finite"),
    ({"residual": 3.0}, TypeError, "`residual` must be a torch.Tensor, got float"),
    ({"residual": ((5, 8), torch.int32)}, TypeError, "`residual` must have dtype in"),
    ({"residual": ((5, 7), torch.float32)}, ValueError, "`residual` must have the shape of `x`"),
]


def bad_arguments(change, device):
    args = {"x": GOOD["x"], "weight": GOOD["weight"], "eps": 1e-6, "residual": None, **change}
    for name in ("x", "weight", "residual"):
        value = args[name]
        if isinstance(value, tuple):
            args[name] = make(*value, device)
    return args


@pytest.mark.parametrize(("change", "error", "message"), BAD_CASES)
def test_bad_input_raises_naming_the_argument(change, error, message, device):
    args = bad_arguments(change, device)
    with pytest.raises(error, match=r"^rms_norm: .*" + re.escape(message)):
        rms_norm(**args)


def test_residual_on_another_device_raises(device):
    x, weight, _ = inputs(((5,), 8), torch.float32, device)
    with pytest.raises(ValueError, match="`residual` must be on the device of `x`"):
        rms_norm(x, weight, residual=torch.empty(5, 8, device="meta"))
    with pytest.raises(ValueError, match="`weight` must be on the device of `x`"):
        rms_norm(x, torch.empty(8, device="meta"))


# The ops' schemas check argument types first (a RuntimeError naming none): tensor cases only.
TENSOR_CASES = [c for c in BAD_CASES if all(isinstance(v, tuple) for v in c[0].values())]


@pytest.mark.parametrize(("change", "error", "message"), TENSOR_CASES)
def test_op_by_name_raises_naming_the_argument(change, error, message, device):
    args = bad_arguments(change, device)
    with pytest.raises(error, match=re.escape(message)):
        fwd_op(args["x"], args["weight"], args["eps"], args["residual"])


def test_int_eps_is_taken_as_a_float(device):
    x, weight, _ = inputs(((3,), 7), torch.float32, device)
    assert torch.equal(rms_norm(x, weight, 1), rms_norm(x, weight, 1.0))


# --- module, compile, opcheck --------------------------------------------------------------------


def test_module_is_llama_rmsnorm_shaped(device):
    norm = LlamaStyleRMSNorm(33, eps=1e-5).to(device)
    assert torch.equal(norm.weight, torch.ones(33, device=device))
    assert norm.variance_epsilon == 1e-5 and set(norm.state_dict()) == {"weight"}
    with torch.no_grad():
        norm.weight.copy_(rand((33,), torch.float32, device))
    x, _, r = inputs(((2, 3), 33), torch.float32, device, residual=True)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-5))
    y, s = norm(x, r)
    assert torch.equal(y, rms_norm(x, norm.weight, 1e-5, r)[0]) and torch.equal(s, x + r)
    norm(x).sum().backward()
    assert norm.weight.grad is not None


def test_module_matches_transformers_llama_rmsnorm(device):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    theirs = llama.LlamaRMSNorm(130, eps=1e-6).to(device)
    with torch.no_grad():
        theirs.weight.copy_(rand((130,), torch.float32, device))
    ours = LlamaStyleRMSNorm(130).to(device)
    ours.load_state_dict(theirs.state_dict())
    x = rand((5, 130), torch.bfloat16, device)  # bf16 activations, float32 weight: autocast's case
    expected = theirs(x)
    got = ours(x)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2**-7 if not ON_GPU else 1e-6, atol=1e-6)


def test_module_rejects_bad_hidden_size():
    with pytest.raises(ValueError, match="LlamaStyleRMSNorm: `hidden_size` must be a positive int"):
        LlamaStyleRMSNorm(0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, "float32"], ids=str)
def test_module_rejects_a_dtype_the_kernel_does_not_take(dtype):
    with pytest.raises(
        TypeError,
        match=rf"LlamaStyleRMSNorm: `dtype` must be None or one of \(float16, bfloat16, "
        rf"float32\), got {dtype}",
    ):
        LlamaStyleRMSNorm(8, dtype=dtype)
    assert LlamaStyleRMSNorm(8, dtype=torch.bfloat16).weight.dtype == torch.bfloat16


def test_rmsnorm_is_the_earlier_name_of_the_module():
    assert RMSNorm is LlamaStyleRMSNorm


def test_compile_fullgraph_forward_and_backward(device):
    def block(x, weight, r):
        y, s = rms_norm(x, weight, 1e-6, r)
        return y * 2, s

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x, weight, r = inputs(((5,), 33), torch.float32, device, residual=True)
    grad_y, grad_s = rand(x.shape, torch.float32, device), rand(x.shape, torch.float32, device)

    def run(fn):
        leaves = [t.detach().requires_grad_() for t in (x, weight, r)]
        out = fn(*leaves)
        return (*out, *torch.autograd.grad(out, leaves, (grad_y, grad_s)))

    torch.testing.assert_close(run(compiled), run(block))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_opcheck(residual, device):
    x, weight, r = inputs(((5,), 33), torch.float32, device, residual=residual)
    torch.library.opcheck(fwd_op.default, (x, weight, 1e-6, r))
    _, s, rstd = fwd_op(x, weight, 1e-6, r)
    grad_y = rand(x.shape, torch.float32, device)
    grad_s = rand(x.shape, torch.float32, device) if residual else None
    torch.library.opcheck(bwd_op.default, (grad_y, grad_s, s if residual else x, weight, rstd))


def test_opcheck_differentiable(device):
    x, weight, r = inputs(((5,), 33), torch.float32, device, residual=True)
    args = (x.requires_grad_(), weight.requires_grad_(), 1e-6, r.requires_grad_())
    torch.library.opcheck(fwd_op.default, args)


def test_a_residual_of_another_dtype_adds_into_x_dtype(device):
    """Under autocast the residual stream is float32 and the attention's output bfloat16: the
    sum is rounded to ``x``'s dtype, as ``x + residual`` then ``.to(x.dtype)``, and each input's
    gradient comes back in its own dtype."""
    x = torch.randn(5, 8, device=device, requires_grad=True)
    residual = torch.randn(5, 8, device=device).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(8, device=device)
    y, s = rms_norm(x, weight, 1e-6, residual=residual)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, x + residual.float())
    torch.testing.assert_close(y, rms_norm_reference(x + residual.float(), weight, 1e-6))
    (y.sum() + s.sum()).backward()
    assert residual.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    torch.testing.assert_close(residual.grad, x.grad.to(torch.bfloat16))
