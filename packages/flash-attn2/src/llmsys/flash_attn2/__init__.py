"""FlashAttention-2 in plain PyTorch and in Triton: causal, grouped-query, deterministic backward.

Importing this package registers ``torch.ops.llmsys.flash_attn2_fwd``,
``torch.ops.llmsys.flash_attn2_bwd``, ``torch.ops.llmsys.flash_attn2_decode`` (decode attention
over a static KV cache, float or int8, ``decode_attention``) and
``torch.ops.llmsys.flash_attn2_append_kv_int8`` (new keys and values quantized into an int8 KV
cache, ``append_kv_int8``).
"""

from .decode import decode_attention
from .flash_torch import FlashAttention2Torch
from .functional import FlashAttention2Triton, flash_attention
from .kv_cache_int8 import append_kv_int8
from .modules import FlashSelfAttention
from .reference import attention_reference, quantize_kv_int8_reference

__version__ = "0.2.0"

__all__ = [
    "FlashAttention2Torch",
    "FlashAttention2Triton",
    "FlashSelfAttention",
    "__version__",
    "append_kv_int8",
    "attention_reference",
    "decode_attention",
    "flash_attention",
    "quantize_kv_int8_reference",
]
