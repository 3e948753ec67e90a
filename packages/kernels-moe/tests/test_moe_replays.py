"""The ops declared ``replays=True`` replay their recorded plans at a typical shape (GPU only):
an impl that starts doing more than check, allocate and launch fails here instead of costing
host time silently. The permute replays with ``out_rows`` given (without, it reads the row count
back on every call)."""

import pytest
import torch
from moe_helpers import random_routing

from llmsys.kernels_moe import moe_unpermute, ops, padded_moe_permute
from llmsys.triton_launch.testing import assert_replays


@pytest.mark.gpu
def test_gpu_ops_replay_at_a_typical_shape():
    tokens, hidden, topk, experts, align = 4096, 4096, 2, 8, 128
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    top, counts = random_routing(tokens, topk, experts, "cuda")
    weights = torch.rand(tokens, topk, device="cuda", dtype=torch.bfloat16)
    out_rows = tokens * topk + experts * (align - 1)

    def moe_round_trip():
        rows, _, row_index = padded_moe_permute(
            x, top, counts, topk, experts, align=align, out_rows=out_rows, return_row_index=True
        )
        return moe_unpermute(rows, row_index, weights)

    assert_replays(moe_round_trip, ops.moe_permute, ops.moe_unpermute)
