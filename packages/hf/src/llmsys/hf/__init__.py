"""Every llmsys kernel that fits, put into a Hugging Face Llama-, Mistral- or Qwen2-family model
in one call: ``apply_llmsys(model)``."""

from .apply import apply_llmsys

__version__ = "0.1.0"

__all__ = ["__version__", "apply_llmsys"]
