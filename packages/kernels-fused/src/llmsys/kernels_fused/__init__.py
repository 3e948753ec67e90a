"""Fused transformer-layer kernels in Triton: RMSNorm (with the residual add), rotary embeddings on
q and k in one launch (also with a decode step's KV-cache append: ``rotary_into_cache``), and the
output projection fused with cross-entropy so the logits are never materialised.

Importing this package registers its ``torch.ops.llmsys_fused`` ops.
"""

from .linear_cross_entropy import causal_lm_loss, linear_cross_entropy
from .modules import LlamaStyleRMSNorm, RMSNorm
from .reference import (
    linear_cross_entropy_reference,
    rms_norm_backward_reference,
    rms_norm_reference,
    rotary_backward_reference,
    rotary_reference,
)
from .rms_norm import rms_norm
from .rotary import apply_rotary_pos_emb, rotary
from .rotary_cache import rotary_into_cache

__version__ = "0.1.0"

__all__ = [
    "LlamaStyleRMSNorm",
    "RMSNorm",
    "__version__",
    "apply_rotary_pos_emb",
    "causal_lm_loss",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "rms_norm",
    "rms_norm_backward_reference",
    "rms_norm_reference",
    "rotary",
    "rotary_backward_reference",
    "rotary_into_cache",
    "rotary_reference",
]
