"""The ops declared ``replays=True`` replay their recorded plans at a typical shape (GPU only):
an impl that starts doing more than check, allocate and launch fails here instead of costing
host time silently."""

import pytest
import torch

from llmsys.flash_attn2 import decode, decode_attention, flash_attention, ops
from llmsys.triton_launch.testing import assert_replays


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(1, 8, 1024, 128), (1, 32, 4096, 128)],
    ids=["pointer", "tma-on-hopper"],  # the second is past TMA_MIN_FLOPS
)
def test_gpu_ops_replay_at_a_typical_shape(shape):
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    assert_replays(lambda: flash_attention(q, k, v, causal=True), ops.flash_attn2_fwd)
    for t in (q, k, v):
        t.requires_grad_()
    grad_out = torch.randn_like(q)
    assert_replays(
        lambda: flash_attention(q, k, v, causal=True).backward(grad_out),
        ops.flash_attn2_fwd,
        ops.flash_attn2_bwd,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_decode_op_replays_at_a_typical_shape(q_len):
    # Llama-3.1-8B decode: 32 query heads on 8 kv heads, batch 8, a 4096-token static cache.
    q = torch.randn(8, 32, q_len, 128, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (
        torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv"
    )
    seqlens = torch.full((8,), 1024, device="cuda", dtype=torch.int32)
    assert_replays(
        lambda: decode_attention(q, k_cache, v_cache, seqlens), decode.flash_attn2_decode
    )
