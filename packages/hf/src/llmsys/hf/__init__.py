"""Every llmsys kernel that fits, put into a Hugging Face Llama-, Mistral- or Qwen2-family model
in one call: ``apply_llmsys(model)``; and greedy generation over a static KV cache, each decode
step replayed from a CUDA graph: ``generate(model, input_ids, max_new_tokens)``."""

from .apply import apply_llmsys
from .generation import cached_forward, generate

__version__ = "0.1.0"

__all__ = ["__version__", "apply_llmsys", "cached_forward", "generate"]
