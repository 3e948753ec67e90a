"""RMSNorm on the GPU: Llama sizes, bfloat16 against eager bit for bit (or within the last bit),
torch.compile (fullgraph, reduce-overhead), CUDA graphs, the chunked path for long rows, and more
than 2**31 elements. (The int8 variant's GPU tests are in kernels-int8.)"""

import importlib
import math

import pytest
import torch

from llmsys.kernels_fused import (
    LlamaStyleRMSNorm,
    rms_norm,
    rms_norm_reference,
)
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu

rms_module = importlib.import_module("llmsys.kernels_fused.rms_norm")
fwd_op = torch.ops.llmsys_fused.rms_norm_fwd
bwd_op = torch.ops.llmsys_fused.rms_norm_bwd

LLAMA_N = [2048, 4096, 8192]  # Llama 3.2 1B, Llama 3 8B, Llama 3 70B hidden sizes
ROWS = 8192
BF16_WEIGHTS = [torch.bfloat16, torch.float32]  # plain bf16, and autocast's float32 weight


def rand(shape, dtype, scale: float = 2.0) -> torch.Tensor:
    return (scale * torch.randn(shape, device="cuda") + 0.5).to(dtype)


def inputs(m, n, dtype=torch.bfloat16, weight_dtype=torch.bfloat16, residual=False):
    x = rand((m, n), dtype)
    weight = rand((n,), weight_dtype, scale=1.0)
    return x, weight, rand((m, n), dtype) if residual else None


def twice_eager(ours, eager, exact, rounding_dtype, name="") -> tuple[float, float]:
    """max|ours - exact| <= 2 max|eager - exact| + one ulp of rounding_dtype at the max value."""
    exact = exact.double()
    err_ours = (ours.double() - exact).abs().max().item()
    err_eager = (eager.double() - exact).abs().max().item()
    floor = torch.finfo(rounding_dtype).eps * exact.abs().max().item()
    assert err_ours <= 2 * err_eager + floor, f"{name}: ours {err_ours:.3g}, eager {err_eager:.3g}"
    return err_ours, err_eager


def assert_near_bitwise(ours, eager, max_mismatch: float = 1e-3) -> None:
    """Equal bits except a few elements one rounding step away: the row's sum of squares is
    added in another order than eager's and rsqrt is rounded differently (eager's rsqrtf is
    within 2 ulps, ours within 1), which flips the bfloat16 rounding of the normalised value
    now and then."""
    mismatch = (ours != eager).float().mean().item()
    assert mismatch <= max_mismatch, f"{mismatch:.2%} of the elements differ"
    # A flipped bfloat16 normalised value moves y by a bfloat16 ulp, also where a float32
    # weight makes y float32; with a bfloat16 weight y's own rounding can add one more.
    ulp = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(ours, eager, rtol=2 * ulp, atol=ulp * 1e-3)


def float64(*tensors):
    return tuple(None if t is None else t.double() for t in tensors)


# --- forward at Llama sizes ----------------------------------------------------------------------


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("weight_dtype", BF16_WEIGHTS, ids=str)
@pytest.mark.parametrize("n", LLAMA_N)
def test_llama_sizes_bf16_forward(n, weight_dtype, residual):
    x, weight, r = inputs(ROWS, n, weight_dtype=weight_dtype, residual=residual)
    ours = rms_norm(x, weight, 1e-5, r)
    eager = rms_norm_reference(x, weight, 1e-5, r)
    exact = rms_norm_reference(*float64(x, weight), 1e-5, *float64(r))
    if residual:
        assert torch.equal(ours[1], eager[1])  # s = x + residual, as eager rounds it
        ours, eager, exact = ours[0], eager[0], exact[0]
    assert ours.dtype == torch.promote_types(torch.bfloat16, weight_dtype)
    assert_near_bitwise(ours, eager)
    twice_eager(ours, eager, exact, torch.bfloat16, "y")


@pytest.mark.parametrize("n", LLAMA_N)
def test_llama_sizes_float32_forward(n):
    x, weight, _ = inputs(1024, n, torch.float32, torch.float32)
    ours, eager = rms_norm(x, weight), rms_norm_reference(x, weight)
    exact = rms_norm_reference(*float64(x, weight))
    torch.testing.assert_close(ours, eager, rtol=3e-6, atol=1e-6)
    twice_eager(ours, eager, exact, torch.float32, "y")


# --- backward at Llama sizes ---------------------------------------------------------------------


def grads(fn, x, weight, r, grad_y, grad_s):
    leaves = [t.detach().requires_grad_() for t in (x, weight, r) if t is not None]
    out = fn(leaves[0], leaves[1], 1e-5, leaves[2] if r is not None else None)
    outputs, cotangents = (out, (grad_y, grad_s)) if r is not None else ((out,), (grad_y,))
    return torch.autograd.grad(outputs, leaves, cotangents)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("weight_dtype", BF16_WEIGHTS, ids=str)
@pytest.mark.parametrize("n", LLAMA_N)
def test_llama_sizes_bf16_backward(n, weight_dtype, residual):
    x, weight, r = inputs(ROWS, n, weight_dtype=weight_dtype, residual=residual)
    grad_y = rand(x.shape, torch.promote_types(x.dtype, weight_dtype), scale=1.0)
    grad_s = rand(x.shape, x.dtype, scale=1.0) if residual else None
    ours = grads(rms_norm, x, weight, r, grad_y, grad_s)
    eager = grads(rms_norm_reference, x, weight, r, grad_y, grad_s)
    exact = grads(rms_norm_reference, *float64(x, weight, r, grad_y, grad_s))
    for name, o, e, ex in zip(["x", "weight", "residual"], ours, eager, exact, strict=False):
        assert o.dtype == e.dtype
        twice_eager(o, e, ex, torch.bfloat16, name)
    again = grads(rms_norm, x, weight, r, grad_y, grad_s)
    assert all(torch.equal(a, b) for a, b in zip(ours, again, strict=True))  # deterministic


# --- long rows: the chunked path -----------------------------------------------------------------


@pytest.mark.parametrize("n", [16384, 32768 + 3])
def test_long_rows_forward_and_backward(n):
    x, weight, r = inputs(67, n, residual=True)
    grad_y, grad_s = rand(x.shape, x.dtype, 1.0), rand(x.shape, x.dtype, 1.0)
    ours = rms_norm(x, weight, 1e-5, r)
    eager = rms_norm_reference(x, weight, 1e-5, r)
    exact = rms_norm_reference(*float64(x, weight), 1e-5, *float64(r))
    twice_eager(ours[0], eager[0], exact[0], torch.bfloat16, "y")
    assert torch.equal(ours[1], eager[1])
    got = grads(rms_norm, x, weight, r, grad_y, grad_s)
    expected = grads(rms_norm_reference, x, weight, r, grad_y, grad_s)
    exact = grads(rms_norm_reference, *float64(x, weight, r, grad_y, grad_s))
    for name, o, e, ex in zip(["x", "weight", "residual"], got, expected, exact, strict=True):
        twice_eager(o, e, ex, torch.bfloat16, name)


def test_chunked_path_matches_one_pass(monkeypatch):
    x, weight, r = inputs(1000, 4096 + 5, residual=True)
    one_pass = rms_norm(x, weight, 1e-5, r)
    monkeypatch.setattr(rms_module, "MAX_BLOCK_N", 1024)
    monkeypatch.setattr(rms_module, "MAX_BLOCK_N_BWD", 1024)
    chunked = rms_norm(x, weight, 1e-5, r)
    assert_near_bitwise(chunked[0], one_pass[0])
    assert torch.equal(chunked[1], one_pass[1])


# --- more than 2**31 elements --------------------------------------------------------------------


def test_more_than_2_31_elements():
    n = 2048
    m = (1 << 31) // n + 3
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    weight = rand((n,), torch.bfloat16, 1.0)
    y = rms_norm(x, weight)
    tail = slice(m - 5, m)  # rows past 2**31 elements
    assert torch.equal(y[tail], rms_norm(x[tail].clone(), weight))
    assert_near_bitwise(y[tail], rms_norm_reference(x[tail], weight), max_mismatch=0.01)
    del y
    grad_y = torch.randn_like(x)
    dx, dweight = bwd_op(grad_y, None, x, weight, fwd_op(x, weight, 1e-6, None)[2])
    _, _, rstd = fwd_op(x[tail].clone(), weight, 1e-6, None)
    dx_tail, _ = bwd_op(grad_y[tail].clone(), None, x[tail].clone(), weight, rstd)
    assert torch.equal(dx[tail], dx_tail)
    assert math.isfinite(dweight.float().sum().item())


# --- torch.compile and CUDA graphs ---------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_forward_and_backward_match_eager(mode):
    norm = LlamaStyleRMSNorm(4096, eps=1e-5, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        norm.weight.copy_(rand((4096,), torch.float32, 1.0))

    def layer(x, r):
        y, s = norm(x, r)
        return y * 2, s

    compiled = torch.compile(layer, fullgraph=True, mode=mode)

    def step(fn, x, r, grad_y, grad_s):
        x, r = x.detach().requires_grad_(), r.detach().requires_grad_()
        norm.weight.grad = None
        out = fn(x, r)
        got = (*out, *torch.autograd.grad(out, (x, r, norm.weight), (grad_y, grad_s)))
        return [t.clone() for t in got]

    for _ in range(3):  # reduce-overhead records on the first calls, replays after
        x, _, r = inputs(512, 4096, residual=True)
        grad_y, grad_s = rand(x.shape, torch.float32, 1.0), rand(x.shape, x.dtype, 1.0)
        got, expected = step(compiled, x, r, grad_y, grad_s), step(layer, x, r, grad_y, grad_s)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def test_ops_replay_in_a_cuda_graph():
    def fresh():
        return inputs(1000, 4096, residual=True)

    static, new = fresh(), fresh()
    out = replay_in_cuda_graph(lambda x, w, r: fwd_op(x, w, 1e-5, r), static, new)
    expected = fwd_op(*new[:2], 1e-5, new[2])
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))

    def backward_inputs(x, w, r):
        _, s, rstd = fwd_op(x, w, 1e-5, r)
        return (rand(x.shape, x.dtype, 1.0), rand(x.shape, x.dtype, 1.0), s, w, rstd)

    static_b, new_b = backward_inputs(*static), backward_inputs(*new)
    grads_out = replay_in_cuda_graph(bwd_op, static_b, new_b)
    expected = bwd_op(*new_b)
    assert all(torch.equal(g, e) for g, e in zip(grads_out, expected, strict=True))


def test_training_step_replays_in_a_cuda_graph():
    x, weight, r = inputs(512, 2048, residual=True)
    weight.requires_grad_()

    def step(x, r):
        y, s = rms_norm(x, weight, 1e-5, r)
        return torch.autograd.grad((y.float().square().sum() + s.float().sum()), (weight,))[0]

    static = [x, r]
    fresh = [rand(x.shape, x.dtype), rand(r.shape, r.dtype)]
    got = replay_in_cuda_graph(step, static, fresh)
    assert torch.equal(got, step(*fresh))
