"""GPU only: the SiLU-mul-quantize kernel bit-exact against its eager spec at Llama sizes (bfloat16
included, which the interpreter cannot check), CUDA-graph capture and torch.compile of it. (The
decoder layers quantize_model builds with it are tested on a GPU in
packages/hf/tests/test_quantize_gpu.py.)"""

import pytest
import torch

from llmsys.kernels_int8 import silu_mul_quantize_int8, silu_mul_quantize_int8_reference
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def inputs(shape, dtype):
    gate = (3 * torch.randn(shape, device="cuda")).to(dtype)
    return gate, torch.randn(shape, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(1, 14336), (16, 14336), (4096, 14336), (1000, 2816), (7, 40000)],  # 2816: one pass
    ids=lambda s: "x".join(map(str, s)),
)
def test_gpu_bit_exact_at_model_sizes(shape, dtype, poisoned_allocations):
    gate, up = inputs(shape, dtype)
    gate[0] = 0  # a zero row
    up[-1, 5] = float("nan")  # a NaN row
    q, scale = silu_mul_quantize_int8(gate, up)
    q_ref, scale_ref = silu_mul_quantize_int8_reference(gate, up)
    assert torch.equal(q, q_ref), (q.int() - q_ref.int()).abs().max()
    assert torch.equal(scale.isnan(), scale_ref.isnan()) and scale[-1].isnan()
    finite = ~scale_ref.isnan()
    assert torch.equal(scale[finite], scale_ref[finite])


@pytest.mark.parametrize("m", [1, 16, 300])
def test_gpu_replays_in_a_cuda_graph(m):
    gate, up = inputs((m, 14336), torch.bfloat16)
    fresh = inputs((m, 14336), torch.bfloat16)
    q, scale = replay_in_cuda_graph(silu_mul_quantize_int8, [gate, up], list(fresh))
    q_ref, scale_ref = silu_mul_quantize_int8(*fresh)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_compiled_matches_eager(mode):
    compiled = torch.compile(silu_mul_quantize_int8, fullgraph=True, mode=mode)
    for m in (5, 33):
        gate, up = inputs((m, 2816), torch.float16)
        got, expected = compiled(gate, up), silu_mul_quantize_int8(gate, up)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
