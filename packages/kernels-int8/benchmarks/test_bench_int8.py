"""pytest-benchmark cases: the quantizer, the W8A8 GEMM and the two end to end, against eager and
cuBLAS fp16.

On a GPU each case runs at a real size (a Qwen2.5-3B prefill GEMM at M = 16384, a decode GEMM at
M = 16; tools/gpu.py compares the medians with benchmarks/baselines/<gpu>.json). Without one,
CI runs each body once at a tiny size under Triton's interpreter (`--benchmark-disable`), so a
broken kernel still fails here.
"""

import pytest
import torch

import llmsys.kernels_int8 as ki
from llmsys_dev.device import DEVICE, ON_GPU

HALF = torch.float16 if ON_GPU else torch.float32
QUANT_SHAPES = [(16384, 2048), (16384, 11008)] if ON_GPU else [(8, 64)]
GEMM_SHAPES = [(16384, 2048, 6144), (16, 11008, 2048)] if ON_GPU else [(8, 64, 48)]  # M, K, N


def eager_quantize(x):
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8), scale


@pytest.mark.parametrize("impl", ["ours", "eager"])
@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize(benchmark, timed, impl, shape):
    benchmark.group = f"quantize-{shape[0]}x{shape[1]}"
    x = torch.randn(shape, device=DEVICE, dtype=HALF)
    fn = ki.quantize_int8_perrow if impl == "ours" else eager_quantize
    q, scale = timed(lambda: fn(x))
    assert q.dtype == torch.int8 and torch.isfinite(scale).all()
    if impl == "ours":
        assert torch.equal(q, ki.quantize_int8_perrow_reference(x)[0])


def gemm_case(shape):
    m, k, n = shape
    x = torch.randn(m, k, device=DEVICE, dtype=HALF)
    w = torch.randn(n, k, device=DEVICE, dtype=HALF) * 0.02  # nn.Linear layout (N, K)
    return x, w, *ki.quantize_int8(w.t())


@pytest.mark.parametrize("impl", ["ours", "ours_e2e", "cublas_fp16"])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "M{}-K{}-N{}".format(*s))
def test_gemm(benchmark, timed, impl, shape):
    benchmark.group = "gemm-M{}-K{}-N{}".format(*shape)
    x, w, q_w, w_scale = gemm_case(shape)
    q_x, x_scale = ki.quantize_int8_perrow(x)
    fns = {
        "ours": lambda: ki.matmul_int8(q_x, x_scale, q_w, w_scale),
        "ours_e2e": lambda: ki.matmul_quantize_int8(x, q_w, w_scale),
        "cublas_fp16": lambda: x @ w.t(),
    }
    out = timed(fns[impl])
    assert out.shape == (shape[0], shape[2]) and torch.isfinite(out).all()
    if impl != "cublas_fp16":
        rows = slice(0, 8)
        expected = ki.matmul_int8_reference(q_x[rows], x_scale[rows], q_w, w_scale)
        assert torch.equal(out[rows], expected)
