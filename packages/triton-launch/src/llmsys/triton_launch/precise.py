"""``exp``, ``log`` and ``round_half_even`` for Triton kernels that must round as eager PyTorch's
CUDA kernels do.

With ``PRECISE`` (on the GPU) they are libdevice's, which round like CUDA's ``expf``/``logf``/
``rintf``; otherwise ``tl.exp``/``tl.log``: on the GPU the faster approximate ``ex2`` path, and
under the interpreter (which has no libdevice) numpy's, and for ``round_half_even`` a float32
trick exact for the small values quantizers round. Call them from a ``@triton.jit`` function
with ``PRECISE`` a ``tl.constexpr``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def round_half_even(y, PRECISE: tl.constexpr):
    """float32 ``y`` rounded to the nearest integer, ties to even: ``torch.round``'s rule. On the
    GPU libdevice's ``rint`` (one instruction). Without ``PRECISE`` (the interpreter has no
    libdevice), adding and subtracting 1.5 * 2**23 lets float32's own round-to-nearest-even do
    it: exact for ``|y| < 2**22`` only, which a caller that clamps first (a quantizer) meets."""
    if PRECISE:
        return libdevice.rint(y)
    else:
        return (y + 12582912.0) - 12582912.0
