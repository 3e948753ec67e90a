"""``exp`` and ``log`` for Triton kernels that must round as eager PyTorch's CUDA kernels do.

With ``PRECISE`` (on the GPU) they are libdevice's, which round like CUDA's ``expf``/``logf``;
otherwise ``tl.exp``/``tl.log``: on the GPU the faster approximate ``ex2`` path, and under the
interpreter (which has no libdevice) numpy's. Call them from a ``@triton.jit`` function with
``PRECISE`` a ``tl.constexpr``.
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
