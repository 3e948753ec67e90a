"""pytest-benchmark cases: our permute and unpermute against the eager reference, forward only.

On a GPU each case times bfloat16 at the issue's small case and at 4096 tokens x 4096 hidden,
top-8 of 128 experts (tools/gpu.py compares the medians with benchmarks/baselines/<gpu>.json).
Without one, CI runs each body once on a tiny float32 case under Triton's interpreter
(`--benchmark-disable`), so a broken kernel still fails here.
"""

import pytest
import torch

import llmsys.kernels_moe as km
from llmsys_dev.device import DEVICE, ON_GPU

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# (num_tokens, hidden, topk, num_experts)
CASES = [(512, 2048, 2, 8), (4096, 4096, 8, 128)] if ON_GPU else [(8, 16, 2, 4)]
ALIGN = 128 if ON_GPU else 8


def case_id(case) -> str:
    return "T{}-H{}-k{}-E{}".format(*case)


def inputs(case):
    num_tokens, hidden, topk, num_experts = case
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=DTYPE)
    top = torch.rand(num_tokens, num_experts, device=DEVICE).topk(topk, dim=1).indices
    counts = torch.bincount(top.reshape(-1), minlength=num_experts)
    return x, top, counts


PERMUTES = {
    "ours": lambda x, top, counts, k, e, rows: km.padded_moe_permute(
        x, top, counts, k, e, align=ALIGN
    ),
    "ours-out_rows": lambda x, top, counts, k, e, rows: km.padded_moe_permute(
        x, top, counts, k, e, align=ALIGN, out_rows=rows
    ),
    "eager": lambda x, top, counts, k, e, rows: km.padded_moe_permute_reference(
        x, top, counts, k, e, align=ALIGN
    ),
}
UNPERMUTES = {"ours": km.moe_unpermute, "eager": km.moe_unpermute_reference}


@pytest.mark.parametrize("impl", PERMUTES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_permute(benchmark, timed, impl, case):
    benchmark.group = f"permute-{case_id(case)}"
    x, top, counts = inputs(case)
    num_tokens, _, topk, num_experts = case
    bound = num_tokens * topk + num_experts * (ALIGN - 1)
    fn = PERMUTES[impl]

    def permute():
        out, padded = fn(x, top, counts, topk, num_experts, bound)
        return out, padded

    out, _ = timed(permute)
    expected, _ = km.padded_moe_permute_reference(x, top, counts, topk, num_experts, align=ALIGN)
    assert torch.equal(out[: expected.shape[0]], expected) and not out[expected.shape[0] :].any()


@pytest.mark.parametrize("impl", UNPERMUTES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_unpermute(benchmark, timed, impl, case):
    benchmark.group = f"unpermute-{case_id(case)}"
    x, top, counts = inputs(case)
    num_tokens, _, topk, num_experts = case
    grouped, _, row_index = km.padded_moe_permute(
        x, top, counts, topk, num_experts, align=ALIGN, return_row_index=True
    )
    weights = torch.rand(num_tokens, topk, device=DEVICE)
    fn = UNPERMUTES[impl]

    def unpermute():
        y = fn(grouped, row_index, weights)
        return y

    y = timed(unpermute)
    expected = x.float() * weights.sum(1, keepdim=True)
    torch.testing.assert_close(y.float(), expected, rtol=2e-2, atol=2e-2)
