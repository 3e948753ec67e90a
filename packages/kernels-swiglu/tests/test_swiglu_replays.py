"""The ops declared ``replays=True`` replay their recorded plans at a typical shape (GPU only):
an impl that starts doing more than check, allocate and launch fails here instead of costing
host time silently."""

import pytest
import torch

from llmsys.kernels_swiglu import ops, swiglu
from llmsys.triton_launch.testing import assert_replays


@pytest.mark.gpu
def test_gpu_ops_replay_at_a_typical_shape():
    # A Llama-7B MLP's hidden activations for 4096 tokens.
    a, b = (torch.randn(4096, 11008, device="cuda", dtype=torch.bfloat16) for _ in "ab")
    assert_replays(lambda: swiglu(a, b), ops.swiglu_fwd)
    assert_replays(lambda: torch.ops.llm_scaling_week.swiglu_fwd(a, b), ops.swiglu_fwd)
    a.requires_grad_(), b.requires_grad_()
    grad_out = torch.randn_like(a)
    assert_replays(lambda: swiglu(a, b).backward(grad_out), ops.swiglu_fwd, ops.swiglu_bwd)
