"""The Hugging Face model families llmsys rewrites, and their transformers classes by part.

One table for every rewrite in ``llmsys.hf``: ``apply_llmsys`` (training), ``quantize_model``
(W8A8 serving) and ``patch_gated_mlps`` recognise a module by its exact class here, so a
subclass or another family keeps transformers' code. transformers is imported only when
:func:`family_classes` runs.
"""

from __future__ import annotations

import importlib

from torch import nn

# family -> the prefix of its transformers classes (Qwen2 has q, k and v biases)
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
# part -> the suffix of its class in each family
PARTS = {
    "decoder_layer": "DecoderLayer",
    "attention": "Attention",
    "mlp": "MLP",
    "rms_norm": "RMSNorm",
    "causal_lm": "ForCausalLM",
}


def family_classes() -> dict[str, tuple[type, ...]]:
    """Each part's transformers classes over the three families, e.g. ``"mlp"``: (LlamaMLP,
    MistralMLP, Qwen2MLP).

    Raises:
        ImportError: transformers is not installed.
    """
    try:
        modules = {
            family: importlib.import_module(f"transformers.models.{family}.modeling_{family}")
            for family in FAMILIES
        }
    except ImportError as error:
        raise ImportError("llmsys.hf needs transformers: pip install llmsys-hf") from error
    return {
        part: tuple(
            getattr(modules[family], prefix + suffix) for family, prefix in FAMILIES.items()
        )
        for part, suffix in PARTS.items()
    }


def is_silu(activation: nn.Module) -> bool:
    """Whether a gated MLP's ``act_fn`` is SiLU (``hidden_act`` "silu" or "swish")."""
    from transformers.activations import ACT2FN

    return type(activation) in (nn.SiLU, type(ACT2FN["silu"]), type(ACT2FN["swish"]))
