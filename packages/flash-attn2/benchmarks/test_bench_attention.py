"""pytest-benchmark cases: our FlashAttention-2 against SDPA's flash backend, fwd and fwd+bwd.

On a GPU each case times causal bfloat16 at the leaderboard shape 1x16x16384x64 and at
4x16x4096x128 (tools/gpu.py compares the medians with benchmarks/baselines/<gpu>.json). Without
one, CI runs each body once on a tiny float32 problem under Triton's interpreter
(`--benchmark-disable`), so a broken kernel still fails here.
"""

import pytest
import torch
import torch.nn.functional as F

from llmsys.flash_attn2 import attention_reference, flash_attention
from llmsys_dev.device import DEVICE, ON_GPU

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
SHAPES = [(1, 16, 16384, 64), (4, 16, 4096, 128)] if ON_GPU else [(1, 2, 33, 16)]


def sdpa_flash(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def ours(q, k, v):
    return flash_attention(q, k, v, causal=True)


def reference(q, k, v):
    return attention_reference(q, k, v, is_causal=True, upcast=False)[0]


IMPLS = {"ours": ours, "sdpa_flash": sdpa_flash if ON_GPU else reference}


def cases(mode: str) -> list:
    """One case per (impl, shape), named like `fwd-ours-1x16x16384x64`."""
    return [
        pytest.param(impl, shape, id=f"{mode}-{impl}-{'x'.join(map(str, shape))}")
        for shape in SHAPES
        for impl in IMPLS
    ]


@pytest.mark.parametrize(("impl", "shape"), cases("fwd"))
def test_forward(benchmark, timed, impl, shape):
    benchmark.group = "fwd-" + "x".join(map(str, shape))
    fn = IMPLS[impl]
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE) for _ in range(3))

    def forward():
        out = fn(q, k, v)
        return out

    out = timed(forward)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference(q, k, v).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("impl", "shape"), cases("fwdbwd"))
def test_forward_backward(benchmark, timed, impl, shape):
    benchmark.group = "fwdbwd-" + "x".join(map(str, shape))
    fn = IMPLS[impl]
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=DEVICE, dtype=DTYPE)

    def forward_backward():
        grads = torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)
        return grads

    assert all(torch.isfinite(g).all() for g in timed(forward_backward))
