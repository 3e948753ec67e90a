"""Every rewrite of a Hugging Face Llama-, Mistral- or Qwen2-family model, in one place:
``apply_llmsys(model)`` for training (every llmsys kernel that fits), ``quantize_model(model)``
for W8A8 serving, ``generate(model, input_ids, max_new_tokens)`` over a static KV cache with
each decode step replayed from a CUDA graph, and the parts alone: ``register_flash_attention``,
``patch_gated_mlps``, ``rotary_attention_forward``."""

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
