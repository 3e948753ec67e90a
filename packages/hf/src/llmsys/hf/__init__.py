"""The Hugging Face wing of llmsys: every rewrite of a transformers Llama-, Mistral- or
Qwen2-family model, in one place.

- ``apply_llmsys(model)``: for training, every llmsys kernel that fits (FlashAttention-2, the fused
  SwiGLU MLP, RMSNorm with the residual add, rotary, the fused loss);
- ``quantize_model(model)``: for serving, its decoder layers in W8A8, fused;
- ``generate(model, input_ids, max_new_tokens)``: greedy generation over a static KV cache, each
  decode step replayed from a CUDA graph;
- the parts on their own: ``register_flash_attention()`` (``attn_implementation="llmsys_fa2"``),
  ``patch_gated_mlps(model)``, ``rotary_attention_forward`` and the other forwards they bind
  (``llmsys.hf.forwards``, ``llmsys.hf.quantize``), one table of model families
  (``llmsys.hf.families``).
"""

from .apply import apply_llmsys
from .attention import register_flash_attention
from .forwards import rotary_attention_forward
from .generation import cached_forward, generate
from .mlp import SwiGLUGatedMLP, patch_gated_mlps
from .quantize import quantize_model

__version__ = "0.1.0"

__all__ = [
    "SwiGLUGatedMLP",
    "__version__",
    "apply_llmsys",
    "cached_forward",
    "generate",
    "patch_gated_mlps",
    "quantize_model",
    "register_flash_attention",
    "rotary_attention_forward",
]
