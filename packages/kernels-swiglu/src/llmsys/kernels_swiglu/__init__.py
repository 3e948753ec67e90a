"""Fused SwiGLU (``silu(a) * b``) in Triton, forward and backward.

Importing this package registers ``torch.ops.llm_scaling_week.swiglu_fwd`` and
``torch.ops.llm_scaling_week.swiglu_bwd``.
"""

from .functional import swiglu
from .modules import SwiGLUFeedForward
from .reference import swiglu_backward_reference, swiglu_reference

__version__ = "0.1.0"

__all__ = [
    "SwiGLUFeedForward",
    "__version__",
    "swiglu",
    "swiglu_backward_reference",
    "swiglu_reference",
]
