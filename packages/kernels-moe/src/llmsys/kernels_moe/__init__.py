"""Padded MoE token permutation (group tokens by expert, pad each group to `align` rows) and its
weighted inverse, in Triton, differentiable, with a CUDA-graph-safe path.

Importing this package registers ``torch.ops.llmsys.moe_permute``, ``moe_unpermute`` and
``moe_unpermute_backward``.
"""

from .functional import moe_unpermute, padded_moe_permute
from .modules import MoEFeedForward
from .reference import moe_unpermute_reference, padded_moe_permute_reference

__version__ = "0.1.0"

__all__ = [
    "MoEFeedForward",
    "__version__",
    "moe_unpermute",
    "moe_unpermute_reference",
    "padded_moe_permute",
    "padded_moe_permute_reference",
]
