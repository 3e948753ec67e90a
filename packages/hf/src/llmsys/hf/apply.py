"""``apply_llmsys``: every llmsys kernel that fits, put into a Hugging Face model in one call."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from . import forwards
from .attention import ATTN_IMPLEMENTATION, register_flash_attention
from .families import family_classes
from .mlp import SwiGLUGatedMLP, patch_gated_mlps
from .rewrite import original_class, rewrite

logger = logging.getLogger(__name__)

PARTS = ("attention", "mlp", "rms_norm", "rotary", "loss")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the fused kernels' dtypes


def apply_llmsys(
    model: nn.Module,
    *,
    attention: bool = True,
    mlp: bool = True,
    rms_norm: bool = True,
    rotary: bool = True,
    loss: bool = True,
) -> dict[str, list[str]]:
    """Put every llmsys kernel that fits into a Llama-, Mistral- or Qwen2-family model, in place.

    Args:
        model: a transformers ``LlamaForCausalLM``, ``MistralForCausalLM`` or
            ``Qwen2ForCausalLM`` (or their base ``*Model``, or any module holding their decoder
            layers).
        attention: ``attn_implementation="llmsys_fa2"`` (:func:`register_flash_attention`).
        mlp: the gated MLPs through the fused SwiGLU (:func:`patch_gated_mlps`).
        rms_norm: every RMSNorm through ``llmsys.kernels_fused.rms_norm``, the residual add
            after attention fused into the post-attention norm.
        rotary: q and k rotated by ``llmsys.kernels_fused.rotary`` in one launch.
        loss: with ``labels=``, the causal-LM loss from the hidden states through
            ``llmsys.kernels_fused.causal_lm_loss``: the logits are never materialised, and
            the output's ``logits`` is ``None``. Without labels the logits come as before.

    Returns:
        What was replaced: for each part, the names of the modules it replaced (also logged at
        INFO by the ``llmsys.hf.apply`` logger). Calling it again replaces nothing more, and
        warns (``UserWarning``) that the model was already rewritten.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, its floating-point parameters are not
            float16, bfloat16 or float32 (float64, say), or a part's switch is not a bool.
        ValueError: the model has no decoder layer of the three families, or a part does not fit
            it (an MLP activation other than SiLU, partial rotary, no causal-LM head for
            ``loss``), or the model holds ``llmsys.kernels_int8`` modules (``quantize_model``,
            ``quantize_linears``); nothing is replaced then.
        ImportError: transformers is not installed.

    Each replaced forward is that module's alone (``llmsys.hf.rewrite``): other models in the
    process keep transformers' code, and the model still pickles, deep-copies and checkpoints
    its layers (``gradient_checkpointing_enable``) as before. Generation with a KV cache works
    (llmsys_fa2 decodes one token at a time over a ``DynamicCache``; with ``attention`` and
    ``rotary``, a ``StaticCache``, as ``llmsys.hf.generate`` fills, is read in place by
    flash-attn2's decode kernel); the model works under ``torch.compile``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_llmsys: `model` must be an nn.Module, got {type(model).__name__}")
    switches = dict(attention=attention, mlp=mlp, rms_norm=rms_norm, rotary=rotary, loss=loss)
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply_llmsys: `{name}` must be a bool, got {type(value).__name__}")
    classes = family_classes()
    named = list(model.named_modules())

    # (name, module) of the model's modules of one part: transformers' classes, whose attributes
    # (self_attn.config, input_layernorm, ...) mypy does not know
    def of(part: str) -> list[tuple[str, Any]]:
        return [(n, m) for n, m in named if original_class(m) in classes[part]]

    layers = of("decoder_layer")
    if not layers:
        found = sorted({type(m).__name__ for _, m in named if "DecoderLayer" in type(m).__name__})
        raise ValueError(
            "apply_llmsys: `model` must hold Llama-, Mistral- or Qwen2-family decoder layers "
            f"(LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer), got "
            f"{', '.join(found) or 'none'} in {type(model).__name__}"
        )
    quantized = [n for n, m in named if type(m).__module__.startswith("llmsys.kernels_int8")]
    if quantized:
        raise ValueError(
            "apply_llmsys: `model` is quantized already (llmsys.kernels_int8 modules, e.g. "
            f"{quantized[0]!r}); the training kernels need its float layers: call apply_llmsys "
            "on the float model (quantize_model after it falls back to a plain int8 swap)"
        )
    found = sorted(
        {str(p.dtype) for p in model.parameters() if p.is_floating_point()}
        - {str(dtype) for dtype in DTYPES}
    )
    if found:
        raise TypeError(
            "apply_llmsys: `model` must hold float16, bfloat16 or float32 parameters (the "
            f"kernels' dtypes), got {', '.join(found)}; cast it first, e.g. model.float()"
        )
    config = layers[0][1].self_attn.config
    if rotary and not forwards.full_width_rotary(config):
        raise ValueError(
            "apply_llmsys: `rotary` fits full-width rotary embeddings only, got "
            f"partial_rotary_factor={config.partial_rotary_factor}; pass rotary=False"
        )
    heads = of("causal_lm")
    if loss and not heads:
        raise ValueError(
            f"apply_llmsys: `loss` needs a causal-LM model (LlamaForCausalLM, ...), got "
            f"{type(model).__name__}; pass loss=False"
        )
    report: dict[str, list[str]] = {part: [] for part in PARTS}
    # the MLPs first: patch_gated_mlps checks every one and raises before changing anything
    if mlp and not all(isinstance(layer.mlp, SwiGLUGatedMLP) for _, layer in layers):
        patch_gated_mlps(model)
        report["mlp"] = [f"{n}.mlp" for n, _ in layers]
    if attention and config._attn_implementation != ATTN_IMPLEMENTATION:
        set_attn_implementation = getattr(model, "set_attn_implementation", None)
        if set_attn_implementation is not None:  # a transformers PreTrainedModel
            set_attn_implementation(register_flash_attention())
        else:
            config._attn_implementation = register_flash_attention()
        report["attention"] = [f"{n}.self_attn" for n, _ in layers]
    if rms_norm:
        report["rms_norm"] = [n for n, m in of("rms_norm") if rewrite(m, forwards.rms_norm_forward)]
        norm_classes = classes["rms_norm"]
        for _, layer in layers:  # the fused add needs both of the layer's norms to be ours
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if all(original_class(norm) in norm_classes for norm in norms):
                rewrite(layer, forwards.float_decoder_layer_forward)
    if rotary:
        report["rotary"] = [
            n for n, m in of("attention") if rewrite(m, forwards.rotary_attention_forward)
        ]
    if loss:
        report["loss"] = [
            n or type(m).__name__ for n, m in heads if rewrite(m, forwards.causal_lm_forward)
        ]
    if any(switches.values()) and not any(report.values()):
        warnings.warn(
            f"apply_llmsys: nothing left to replace: `model` ({type(model).__name__}) was "
            "already rewritten by apply_llmsys, so every part asked for is in place",
            stacklevel=2,
        )
    logger.info(
        "apply_llmsys: %s",
        "; ".join(f"{part}: {len(names)} replaced" for part, names in report.items()),
    )
    return report
