"""Every op under torch.compile (inductor, fullgraph, reduce-overhead) and in CUDA graphs, with
the autotuner on: tuned before the capture, or (a shape never seen) its first candidate."""

import pytest
import torch

from llmsys.kernels_int8 import (
    matmul_int8,
    matmul_int8_reference,
    matmul_quantize_int8,
    matmul_quantize_int8_reference,
    quantize_int8,
    quantize_int8_perrow_reference,
    tuning,
)
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu


@pytest.fixture
def autotune(monkeypatch):
    monkeypatch.setattr(tuning, "AUTOTUNE", True)
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def weights(k, n):
    return quantize_int8(torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02)


def activations(m, k):
    return torch.randn(m, k, device="cuda", dtype=torch.float16)


@pytest.mark.parametrize("m", [1, 16, 300])
def test_every_op_replays_in_a_cuda_graph(m, autotune):
    k, n = 256, 512
    b, b_scale = weights(k, n)
    x = activations(m, k)
    q, scale = replay_in_cuda_graph(
        torch.ops.llmsys.int8_quantize_perrow, [x], [new := activations(m, k)]
    )
    eager_q, eager_scale = torch.ops.llmsys.int8_quantize_perrow(new)
    assert torch.equal(q, eager_q) and torch.equal(scale, eager_scale)
    assert torch.equal(q, quantize_int8_perrow_reference(new)[0])

    a, a_scale = quantize_int8_perrow_reference(activations(m, k))
    new_a, new_scale = quantize_int8_perrow_reference(activations(m, k))
    out = replay_in_cuda_graph(
        matmul_int8, [a, a_scale, b, b_scale], [new_a, new_scale, b, b_scale]
    )
    assert torch.equal(out, matmul_int8(new_a, new_scale, b, b_scale))
    reference = matmul_int8_reference(new_a, new_scale, b, b_scale, None, out.dtype)
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)

    target = torch.empty(m, n, device="cuda", dtype=torch.float16)
    got = replay_in_cuda_graph(
        lambda x: matmul_quantize_int8(x, b, b_scale, out=target), [x], [new := activations(m, k)]
    )
    assert got is target
    assert torch.equal(target, matmul_quantize_int8(new, b, b_scale))


def test_a_shape_first_seen_inside_the_capture_takes_the_first_candidate(autotune):
    b, b_scale = weights(512, 1024)
    x = activations(16, 512)
    graph = torch.cuda.CUDAGraph()
    matmul_quantize_int8(activations(16, 256), *weights(256, 64))  # the kernels exist; not this key
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = matmul_quantize_int8(x, b, b_scale)  # no timing, no sync inside the capture
    x.copy_(new := activations(16, 512))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, matmul_quantize_int8(new, b, b_scale))
    reference = matmul_quantize_int8_reference(new, b, b_scale)
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_matches_eager(mode, autotune):
    b, b_scale = weights(256, 384)

    def fn(x):
        return matmul_quantize_int8(torch.relu(x), b, b_scale) * 2

    compiled = torch.compile(fn, fullgraph=True, mode=mode)
    for _ in range(3):
        x = activations(16, 256)
        torch.testing.assert_close(compiled(x), fn(x))
