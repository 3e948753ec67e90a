"""The public, differentiable SwiGLU function."""

from __future__ import annotations

import torch

from . import ops  # registers torch.ops.llm_scaling_week.*


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Fused ``silu(a) * b`` with a fused Triton backward.

    Args:
        a: gate input (e.g. ``x @ w1.T``), any shape, dtype float16, bfloat16, float32 or float64,
            on CUDA (Triton kernel) or CPU (eager reference, or the Triton kernel under
            ``TRITON_INTERPRET=1``).
        b: up input (e.g. ``x @ w3.T``), the same shape, dtype and device as ``a``.

    Returns:
        A new contiguous tensor of ``a``'s shape and dtype. It equals eager ``F.silu(a) * b``
        bit for bit in float16 and bfloat16 (silu is rounded to the input dtype before the
        multiply, as eager does). Non-contiguous inputs are copied to contiguous ones first.

    Raises:
        TypeError: an argument is not a tensor, or the dtypes are unsupported or differ.
        ValueError: the shapes or devices differ.

    Both gradients come from one Triton pass (``torch.ops.llm_scaling_week.swiglu_bwd``); the op
    works under ``torch.compile(fullgraph=True)``. Double backward is not supported.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        ops.check_inputs("swiglu", a=a, b=b)  # a TypeError naming the argument
    return torch.ops.llm_scaling_week.swiglu_fwd(a, b)
