"""Both ops under torch.compile (inductor, fullgraph, reduce-overhead) and in CUDA graphs."""

import pytest
import torch
import torch.nn.functional as F

from llmsys.kernels_swiglu import swiglu, swiglu_backward_reference
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu


def fresh(n=3):
    return [torch.randn(67, 33, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(n)]


def test_forward_and_backward_ops_replay_in_a_cuda_graph():
    static = fresh()
    out = replay_in_cuda_graph(torch.ops.llm_scaling_week.swiglu_fwd, static[:2], new := fresh(2))
    assert torch.equal(out, F.silu(new[0]) * new[1])
    grads = replay_in_cuda_graph(torch.ops.llm_scaling_week.swiglu_bwd, static, new := fresh())
    expected = torch.ops.llm_scaling_week.swiglu_bwd(*new)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
    torch.testing.assert_close(grads, swiglu_backward_reference(*new))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_forward_and_backward_match_eager(mode):
    def forward(a, b):
        return swiglu(a, b) * 2

    def step(fn, a, b, grad_out):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        out = fn(a, b)
        return (out, *torch.autograd.grad(out, (a, b), grad_out))

    compiled = torch.compile(forward, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records on the first calls, replays after
        inputs = fresh()
        got, expected = step(compiled, *inputs), step(forward, *inputs)
        torch.testing.assert_close(got, expected)
