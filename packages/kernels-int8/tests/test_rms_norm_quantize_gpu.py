"""rms_norm_quantize_int8 on the GPU: Llama sizes in bfloat16 against quantizing rms_norm's
output, the chunked path for long rows, non-finite rows, more than 2**31 elements,
torch.compile (fullgraph, reduce-overhead) and CUDA graphs."""

import importlib

import pytest
import torch

from llmsys.kernels_fused import rms_norm
from llmsys.kernels_int8 import (
    quantize_int8_perrow,
    quantize_int8_perrow_reference,
    rms_norm_quantize_int8,
)
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu

norm_module = importlib.import_module("llmsys.kernels_fused.rms_norm")
quantize_op = torch.ops.llmsys.int8_rms_norm_quantize

LLAMA_N = [2048, 4096, 8192]  # Llama 3.2 1B, Llama 3 8B, Llama 3 70B hidden sizes
ROWS = 8192


def rand(shape, dtype, scale: float = 2.0) -> torch.Tensor:
    return (scale * torch.randn(shape, device="cuda") + 0.5).to(dtype)


def inputs(m, n, dtype=torch.bfloat16, weight_dtype=torch.bfloat16, residual=False):
    x = rand((m, n), dtype)
    weight = rand((n,), weight_dtype, scale=1.0)
    return x, weight, rand((m, n), dtype) if residual else None


def assert_quantized_alike(q, scale, q_ref, scale_ref) -> None:
    """Equal rows but for a few: the int8 kernel sums a row's squares in its own order, so its
    1/rms can differ from rms_norm's by an ulp and flip a rounding of y (as rms_norm against
    eager), which moves that row's scale by an ulp or one q by 1."""
    same_rows = (scale == scale_ref) & (q == q_ref).all(dim=1)
    assert same_rows.float().mean().item() >= 0.99, f"{(~same_rows).sum()} rows differ"
    assert (q.int() - q_ref.int()).abs().max().item() <= 1
    ulp = torch.finfo(scale.dtype).eps
    torch.testing.assert_close(scale, scale_ref, rtol=2 * ulp, atol=0)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", LLAMA_N)
def test_bf16_matches_quantizing_rms_norm(n, weight_dtype, residual):
    x, weight, r = inputs(ROWS, n, weight_dtype=weight_dtype, residual=residual)
    x[7] = 0.0  # an all-zero row: scale 0, q 0
    if residual:
        r[7] = 0.0
    out = rms_norm_quantize_int8(x, weight, 1e-5, r)
    y = rms_norm(x, weight, 1e-5, r)
    y = y[0] if residual else y
    assert_quantized_alike(*out[:2], *quantize_int8_perrow_reference(y))
    assert_quantized_alike(*out[:2], *quantize_int8_perrow(y))  # the quantizer kernel's rows
    assert out[1][7] == 0 and (out[0][7] == 0).all()
    if residual:
        assert torch.equal(out[2], x + r)


def test_chunked_path_matches_quantizing_chunked_rms_norm(monkeypatch):
    x, weight, r = inputs(1000, 4096 + 5, residual=True)
    q_one_pass = rms_norm_quantize_int8(x, weight, 1e-5, r)
    monkeypatch.setattr(norm_module, "MAX_BLOCK_N", 1024)
    y_chunked = rms_norm(x, weight, 1e-5, r)[0]
    q, scale, _ = rms_norm_quantize_int8(x, weight, 1e-5, r)
    q_ref, scale_ref = quantize_int8_perrow_reference(y_chunked)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert (q.int() - q_one_pass[0].int()).abs().max().item() <= 1


def test_non_finite_rows():
    x, weight, _ = inputs(64, 4096)
    x[3, 100], x[9, 4000] = float("inf"), float("nan")
    q, scale = rms_norm_quantize_int8(x, weight)
    assert scale[[3, 9]].isnan().all() and (q[[3, 9]] == 0).all()
    finite = [i for i in range(64) if i not in (3, 9)]
    assert scale[finite].isfinite().all()


def test_more_than_2_31_elements():
    n = 2048
    m = (1 << 31) // n + 3
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    weight = rand((n,), torch.bfloat16, 1.0)
    q, _ = rms_norm_quantize_int8(x, weight)
    tail = slice(m - 5, m)  # rows past 2**31 elements
    y_tail = rms_norm(x[tail].clone(), weight)
    assert torch.equal(q[tail], quantize_int8_perrow_reference(y_tail)[0])


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_matches_eager(mode):
    compiled = torch.compile(rms_norm_quantize_int8, fullgraph=True, mode=mode)
    for _ in range(3):
        x, weight, r = inputs(512, 4096, residual=True)
        got = [t.clone() for t in compiled(x, weight, 1e-5, r)]
        expected = rms_norm_quantize_int8(x, weight, 1e-5, r)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_op_replays_in_a_cuda_graph():
    static, new = inputs(1000, 4096, residual=True), inputs(1000, 4096, residual=True)
    out = replay_in_cuda_graph(lambda x, w, r: quantize_op(x, w, 1e-5, r), static, new)
    expected = quantize_op(*new[:2], 1e-5, new[2])
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))
