"""Every op the package declares with ``define_op(..., replays=True)`` replays its recorded
launches at a typical shape (a few tokens of a 4096-wide Llama layer, bfloat16): an impl that
starts calling another ATen op fails here instead of silently costing host time on every call.
(``rms_norm_bwd`` sums its partials with torch and the loss runs torch matmuls: neither is
declared.)"""

import importlib

import pytest
import torch

from llmsys.kernels_fused import rms_norm, rotary, rotary_into_cache
from llmsys.triton_launch.testing import assert_replays

pytestmark = pytest.mark.gpu

rms_module = importlib.import_module("llmsys.kernels_fused.rms_norm")
rotary_module = importlib.import_module("llmsys.kernels_fused.rotary")
cache_module = importlib.import_module("llmsys.kernels_fused.rotary_cache")

BATCH, SEQ, HIDDEN, Q_HEADS, K_HEADS, HEAD_DIM = 1, 8, 4096, 32, 8, 128
CAPACITY = 64  # a static KV cache's slots (rotary_into_cache)
CASES = ["rms_norm", "rms_norm_residual", "rotary_fwd", "rotary_bwd", "rotary_into_cache"]


def rand(*shape):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
def test_declared_op_replays(case):
    x, weight, residual = rand(BATCH * SEQ, HIDDEN), rand(HIDDEN), rand(BATCH * SEQ, HIDDEN)
    # q and k as a Llama attention makes them: projections viewed as heads and transposed
    q = rand(BATCH, SEQ, Q_HEADS * HEAD_DIM).view(BATCH, SEQ, Q_HEADS, HEAD_DIM).transpose(1, 2)
    k = rand(BATCH, SEQ, K_HEADS * HEAD_DIM).view(BATCH, SEQ, K_HEADS, HEAD_DIM).transpose(1, 2)
    cos, sin = rand(1, SEQ, HEAD_DIM), rand(1, SEQ, HEAD_DIM)
    # v and a static cache as transformers' StaticLayer keeps it: one 0-d length, expanded
    v = rand(BATCH, SEQ, K_HEADS * HEAD_DIM).view(BATCH, SEQ, K_HEADS, HEAD_DIM).transpose(1, 2)
    k_cache, v_cache = (
        rand(BATCH, K_HEADS, CAPACITY, HEAD_DIM),
        rand(BATCH, K_HEADS, CAPACITY, HEAD_DIM),
    )
    length = torch.tensor(5, device="cuda")
    call, op = {
        "rms_norm": (lambda: rms_norm(x, weight, 1e-5), rms_module.rms_norm_fwd),
        "rms_norm_residual": (
            lambda: rms_norm(x, weight, 1e-5, residual),
            rms_module.rms_norm_fwd,
        ),
        "rotary_fwd": (lambda: rotary(q, k, cos, sin), rotary_module.rotary_fwd),
        "rotary_bwd": (
            lambda: rotary_module.rotary_bwd(q, k, cos, sin),
            rotary_module.rotary_bwd,
        ),
        "rotary_into_cache": (
            lambda: rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, length.expand(BATCH)),
            cache_module.rotary_into_cache_op,
        ),
    }[case]
    assert_replays(call, op)
