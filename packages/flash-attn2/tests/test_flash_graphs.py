"""Both ops under torch.compile (inductor, fullgraph, reduce-overhead) and in CUDA graphs."""

import pytest
import torch

from llmsys.flash_attn2 import flash_attention
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu


def qkv_grad():
    q = torch.randn(2, 8, 100, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return [q, k, v, torch.randn_like(q)]


def causal_attention(q, k, v):
    return flash_attention(q, k, v, causal=True)


def forward_backward(fn, q, k, v, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return out, *torch.autograd.grad(out, (q, k, v), grad_out)


def test_forward_and_backward_ops_replay_in_a_cuda_graph():
    fwd, bwd = torch.ops.llmsys.flash_attn2_fwd, torch.ops.llmsys.flash_attn2_bwd
    static, new = qkv_grad(), qkv_grad()
    got = replay_in_cuda_graph(lambda q, k, v: fwd(q, k, v, True, 0.125), static[:3], new[:3])
    expected = fwd(*new[:3], True, 0.125)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))

    out, lse = expected
    args = [new[3], *new[:3], out, lse]
    fresh = [torch.randn_like(new[3]), *new[:3], out, lse]
    got = replay_in_cuda_graph(lambda *a: bwd(*a, True, 0.125), args, fresh)
    expected = bwd(*fresh, True, 0.125)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_forward_and_backward_match_eager(mode):
    compiled = torch.compile(causal_attention, fullgraph=True, mode=mode)
    for _ in range(3):
        inputs = qkv_grad()
        got = forward_backward(compiled, *inputs)
        expected = forward_backward(causal_attention, *inputs)
        torch.testing.assert_close(got, expected)
