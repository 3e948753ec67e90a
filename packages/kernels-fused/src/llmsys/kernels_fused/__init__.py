"""Fused transformer-layer kernels in Triton: RMSNorm (with the residual add, and a variant that
writes int8 rows for the int8 GEMM), rotary embeddings on q and k in one launch, and the output
projection fused with cross-entropy so the logits are never materialised.

Importing this package registers its ``torch.ops.llmsys_fused`` ops.
"""

from .reference import rotary_backward_reference, rotary_reference
from .rotary import apply_rotary_pos_emb, rotary

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "apply_rotary_pos_emb",
    "rotary",
    "rotary_backward_reference",
    "rotary_reference",
]
