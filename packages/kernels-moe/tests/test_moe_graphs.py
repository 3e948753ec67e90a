"""The three ops under torch.compile (inductor, fullgraph, reduce-overhead) and in CUDA graphs;
the permute with ``out_rows`` given (the row count is otherwise data)."""

import pytest
import torch
from moe_helpers import rand, random_routing

from llmsys.kernels_moe import moe_unpermute, padded_moe_permute
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu

TOKENS, HIDDEN, TOPK, EXPERTS, ALIGN = 200, 256, 2, 8, 16
ROWS = TOKENS * TOPK + EXPERTS * (ALIGN - 1)


def routing():
    top, counts = random_routing(TOKENS, TOPK, EXPERTS, "cuda", skew=True)
    x = rand((TOKENS, HIDDEN), torch.bfloat16, "cuda")
    weights = torch.rand(TOKENS, TOPK, device="cuda")
    return x, top, counts, weights


def permute_combine(x, top, counts, weights):
    """Permute, a stand-in expert (x2), and the weighted combine."""
    out, _, row_index = padded_moe_permute(
        x, top, counts, TOPK, EXPERTS, align=ALIGN, out_rows=ROWS, return_row_index=True
    )
    return moe_unpermute(out * 2, row_index, weights), row_index


def test_every_op_replays_in_a_cuda_graph():
    static, new = list(routing()), routing()
    got = replay_in_cuda_graph(permute_combine, static, new)
    expected = permute_combine(*new)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))

    expert_out = rand((ROWS, HIDDEN), torch.float32, "cuda")
    grad_y = rand((TOKENS, HIDDEN), torch.float32, "cuda")
    row_index, weights = expected[1], new[3]
    backward = torch.ops.llmsys.moe_unpermute_backward
    args = [grad_y, expert_out, row_index, weights, True]
    fresh = [
        rand(grad_y.shape, grad_y.dtype, "cuda"),
        rand(expert_out.shape, expert_out.dtype, "cuda"),
        row_index,
        weights,
        True,
    ]
    got = replay_in_cuda_graph(backward, args, fresh)
    assert all(torch.equal(g, e) for g, e in zip(got, backward(*fresh), strict=True))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_forward_and_backward_match_eager(mode):
    def step(fn, x, top, counts, weights):
        x, weights = x.detach().requires_grad_(), weights.detach().requires_grad_()
        y, _ = fn(x, top, counts, weights)
        return y, *torch.autograd.grad(y, (x, weights), torch.ones_like(y))

    compiled = torch.compile(permute_combine, fullgraph=True, mode=mode)
    for _ in range(3):
        inputs = routing()
        got, expected = step(compiled, *inputs), step(permute_combine, *inputs)
        torch.testing.assert_close(got, expected)
