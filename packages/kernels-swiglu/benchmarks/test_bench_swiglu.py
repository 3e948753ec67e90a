"""pytest-benchmark cases: our fused SwiGLU against eager ``F.silu(a) * b``, forward and fwd+bwd.

On a GPU each case times bfloat16 at 4096x4096 and 8192x8192 (tools/gpu.py compares the medians
with benchmarks/baselines/<gpu>.json). Without one, CI runs each body once on a tiny float32 tensor
under Triton's interpreter (`--benchmark-disable`), so a broken kernel still fails here.
"""

import pytest
import torch

from llmsys.kernels_swiglu import swiglu, swiglu_reference
from llmsys_dev.device import DEVICE, ON_GPU

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
SHAPES = [(4096, 4096), (8192, 8192)] if ON_GPU else [(8, 16)]
IMPLS = {"ours": swiglu, "eager": swiglu_reference}


def cases(mode: str) -> list:
    """One case per (impl, shape), named like `fwd-ours-4096x4096`."""
    return [
        pytest.param(impl, shape, id=f"{mode}-{impl}-{shape[0]}x{shape[1]}")
        for shape in SHAPES
        for impl in IMPLS
    ]


@pytest.mark.parametrize(("impl", "shape"), cases("fwd"))
def test_forward(benchmark, timed, impl, shape):
    benchmark.group = f"fwd-{shape[0]}x{shape[1]}"
    fn = IMPLS[impl]
    a, b = (torch.randn(shape, device=DEVICE, dtype=DTYPE) for _ in range(2))

    def forward():
        out = fn(a, b)
        return out

    assert torch.isfinite(timed(forward)).all()


@pytest.mark.parametrize(("impl", "shape"), cases("fwdbwd"))
def test_forward_backward(benchmark, timed, impl, shape):
    benchmark.group = f"fwdbwd-{shape[0]}x{shape[1]}"
    fn = IMPLS[impl]
    a, b = (torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(shape, device=DEVICE, dtype=DTYPE)

    def forward_backward():
        grads = torch.autograd.grad(fn(a, b), (a, b), grad_out)
        return grads

    assert all(torch.isfinite(g).all() for g in timed(forward_backward))
