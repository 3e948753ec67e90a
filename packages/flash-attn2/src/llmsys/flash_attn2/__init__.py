"""FlashAttention-2 in plain PyTorch and in Triton: causal, grouped-query, deterministic backward.

Importing this package registers ``torch.ops.llmsys.flash_attn2_fwd``,
``torch.ops.llmsys.flash_attn2_bwd`` and ``torch.ops.llmsys.flash_attn2_decode`` (decode attention
over a static KV cache, ``decode_attention``).
"""

from .decode import decode_attention
from .flash_torch import FlashAttention2Torch
from .functional import FlashAttention2Triton, flash_attention
from .modules import FlashSelfAttention
from .reference import attention_reference

__version__ = "0.2.0"

__all__ = [
    "FlashAttention2Torch",
    "FlashAttention2Triton",
    "FlashSelfAttention",
    "__version__",
    "attention_reference",
    "decode_attention",
    "flash_attention",
]
