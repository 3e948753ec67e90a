"""Every op the package declares with ``define_op(..., replays=True)`` replays its recorded
launches at a typical shape (a few tokens of a 4096-wide Llama layer, bfloat16): an impl that
starts calling another ATen op fails here instead of silently costing host time on every call.
(``rms_norm_bwd`` sums its partials with torch and the loss runs torch matmuls: neither is
declared.)"""

import importlib

import pytest
import torch

from llmsys.kernels_fused import rms_norm, rotary
from llmsys.triton_launch.testing import assert_replays

pytestmark = pytest.mark.gpu

rms_module = importlib.import_module("llmsys.kernels_fused.rms_norm")
rotary_module = importlib.import_module("llmsys.kernels_fused.rotary")

BATCH, SEQ, HIDDEN, Q_HEADS, K_HEADS, HEAD_DIM = 1, 8, 4096, 32, 8, 128
CASES = ["rms_norm", "rms_norm_residual", "rotary_fwd", "rotary_bwd"]


def rand(*shape):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
def test_declared_op_replays(case):
    x, weight, residual = rand(BATCH * SEQ, HIDDEN), rand(HIDDEN), rand(BATCH * SEQ, HIDDEN)
    # q and k as a Llama attention makes them: projections viewed as heads and transposed
    q = rand(BATCH, SEQ, Q_HEADS * HEAD_DIM).view(BATCH, SEQ, Q_HEADS, HEAD_DIM).transpose(1, 2)
    k = rand(BATCH, SEQ, K_HEADS * HEAD_DIM).view(BATCH, SEQ, K_HEADS, HEAD_DIM).transpose(1, 2)
    cos, sin = rand(1, SEQ, HEAD_DIM), rand(1, SEQ, HEAD_DIM)
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
    }[case]
    assert_replays(call, op)
