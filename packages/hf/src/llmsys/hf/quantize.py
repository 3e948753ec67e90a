"""``quantize_model``: a Hugging Face Llama-, Mistral- or Qwen2-family model in W8A8, rewritten
one decoder layer at a time.

Quantizing each ``nn.Linear`` on its own (``quantize_linears``) quantizes the same normalized rows
three times for q, k and v and twice for gate and up, each in a pass of its own. A rewritten
decoder layer runs instead (each bracket is one kernel):

    [RMSNorm -> int8 rows + per-token scales]          rms_norm_quantize_int8
    [q | k | v: one GEMM over concatenated weights]    self_attn.qkv_proj, split into three views
    attention on those views: q and k rotated in one launch, then transformers' KV cache, masks
               and attention implementation (a static
               cache: flash-attn2's decode kernel)     forwards.rotary_attention
    [o_proj: quantize + GEMM]                          an Int8Linear as quantize_linears makes
    [residual add + RMSNorm -> int8 rows + scales]     rms_norm_quantize_int8(residual=)
    [gate | up: one GEMM]                              mlp.gate_up_proj
    [SiLU(gate) * up -> int8 rows + scales]            silu_mul_quantize_int8
    [down_proj GEMM]                                   mlp.down_proj.forward_quantized
    residual add

The attention's ``q_proj``, ``k_proj`` and ``v_proj`` are gone: ``qkv_proj`` replaces them, and
``qkv_widths`` says where its output splits. The new forwards are bound to those instances only
(other models in the process keep transformers' code). The attention and the MLP, called alone,
take float rows and quantize them per token.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmsys.kernels_int8 import (
    Int8Linear,
    quantize_int8_perrow,
    quantize_linears,
    rms_norm_quantize_int8,
    silu_mul_quantize_int8,
)
from llmsys.kernels_int8.ops import FLOAT_DTYPES, inference_only_error

from .attention import register_serving_attention
from .families import PARTS, family_classes, is_silu
from .forwards import rotary_attention
from .mlp import SwiGLUGatedMLP
from .rewrite import original_class, rewrite

logger = logging.getLogger(__name__)

# --- the rewritten forwards (bound to one instance each) ------------------------------------------


def _refuse_grad(x: torch.Tensor, what: str) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        raise inference_only_error(f"quantize_model's {what}")


def _attention_on_rows(
    attn: Any, rows: torch.Tensor, scale: torch.Tensor, lead: torch.Size, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention on int8 rows (M, H) and their scales (M,) of ``lead`` tokens:
    ``(output (..., H), attention weights or None)``."""
    qkv = attn.qkv_proj.forward_quantized(rows, scale).view(*lead, -1)  # (..., Wq + Wk + Wv)
    query, key, value = qkv.split(attn.qkv_widths, dim=-1)  # views, read in place
    return rotary_attention(attn, query, key, value, **kwargs)


def _mlp_on_rows(mlp: Any, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The gated MLP on int8 rows (M, H) and their scales (M,): (M, H)."""
    gate_up = mlp.gate_up_proj.forward_quantized(rows, scale)  # (M, 2I)
    inner = gate_up.shape[1] // 2
    rows, scale = silu_mul_quantize_int8(gate_up[:, :inner], gate_up[:, inner:])  # (M, I), (M,)
    return mlp.down_proj.forward_quantized(rows, scale)  # (M, H)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float (..., H) as int8 rows (M, H) and their per-token scales (M,)."""
    return quantize_int8_perrow(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]))


def w8a8_attention_forward(
    self: Any, hidden_states: torch.Tensor, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention's forward on float rows, for callers of ``layer.self_attn`` alone (the
    decoder layer feeds it int8 rows from its norm): quantize per token, then the fused path.
    Returns ``(output, attention weights or None)`` as transformers' attention does."""
    _refuse_grad(hidden_states, "attention")
    rows, scale = _quantize_rows(hidden_states)
    return _attention_on_rows(self, rows, scale, hidden_states.shape[:-1], **kwargs)


def w8a8_mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP's forward on float rows, for callers of ``layer.mlp`` alone (the decoder
    layer feeds it int8 rows from its norm): quantize per token, then the fused path."""
    _refuse_grad(x, "MLP")
    rows, scale = _quantize_rows(x)
    return _mlp_on_rows(self, rows, scale).view(*x.shape[:-1], self.down_proj.out_features)


def _check_hidden_states(layer: Any, hidden_states: torch.Tensor) -> None:
    """Refuse what the fused path would serve wrongly or through a slower copy: gradients, a
    dtype other than the layer's, a non-contiguous tensor."""
    _refuse_grad(hidden_states, "decoder layer")
    op = "quantize_model's decoder layer"
    dtype = layer.self_attn.qkv_proj.weight_scale.dtype
    if hidden_states.dtype != dtype:
        raise TypeError(
            f"{op}: `hidden_states` must have the layer's dtype {dtype}, got {hidden_states.dtype}"
        )
    if not hidden_states.is_contiguous():
        raise ValueError(
            f"{op}: `hidden_states` must be contiguous, got strides {hidden_states.stride()}"
        )


def w8a8_decoder_layer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The decoder layer in W8A8: transformers' order (norm, attention, add, norm, MLP, add),
    each norm writing int8 rows for the GEMM after it. The keyword arguments (the KV cache,
    ``position_embeddings``, ``position_ids``, ...) go to the attention as transformers' layer
    passes them. (``forwards.float_decoder_layer_forward`` is the float one.)"""
    _check_hidden_states(self, hidden_states)
    norm = self.input_layernorm
    rows, scale = rms_norm_quantize_int8(hidden_states, norm.weight, norm.variance_epsilon)
    lead = hidden_states.shape[:-1]
    attn, _ = _attention_on_rows(
        self.self_attn, rows, scale, lead, attention_mask=attention_mask, **kwargs
    )  # (..., H)
    norm = self.post_attention_layernorm
    rows, scale, hidden_states = rms_norm_quantize_int8(
        attn, norm.weight, norm.variance_epsilon, residual=hidden_states
    )  # (M, H) int8, (M,), hidden + attn (..., H)
    return hidden_states + _mlp_on_rows(self.mlp, rows, scale).view(hidden_states.shape)


# --- recognising a layer --------------------------------------------------------------------------


def _float_linears(owner: nn.Module, names: tuple[str, ...]) -> str | None:
    """Why ``owner``'s projections ``names`` cannot become one int8 GEMM, or None: each a plain
    nn.Linear, of one float dtype and one input width."""
    linears: list[Any] = [getattr(owner, name, None) for name in names]
    for name, linear in zip(names, linears, strict=True):
        if type(linear) is not nn.Linear:
            return f"{name} is {type(linear).__name__}, not nn.Linear"
    if len({linear.weight.dtype for linear in linears}) > 1:
        return f"{', '.join(names)} have different dtypes"
    if linears[0].weight.dtype not in FLOAT_DTYPES:
        return f"{names[0]} weight is {linears[0].weight.dtype}, not float16/bfloat16/float32"
    if len({linear.in_features for linear in linears}) > 1:
        return f"{', '.join(names)} have different in_features"
    return None


def unfit_reason(layer: nn.Module, classes: dict[str, tuple[type, ...]]) -> str | None:
    """Why ``layer`` is not a decoder layer ``quantize_model`` can rewrite, or None if it is."""
    if type(layer) not in classes["decoder_layer"]:
        return f"{type(layer).__name__} is not a Llama-, Mistral- or Qwen2-family decoder layer"
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    for part, module, kind in (("self_attn", attn, "attention"), ("mlp", mlp, "mlp")):
        if type(module) not in classes[kind]:
            return (
                f"{part} is {type(module).__name__}, not a transformers {PARTS[kind]} of the "
                "families"
            )
    for part in ("input_layernorm", "post_attention_layernorm"):
        if type(getattr(layer, part, None)) not in classes["rms_norm"]:
            return f"{part} is {type(getattr(layer, part, None)).__name__}, not an RMSNorm"
    if not is_silu(mlp.act_fn):
        return f"mlp.act_fn is {type(mlp.act_fn).__name__}, not SiLU"
    groups = [
        (attn, ("q_proj", "k_proj", "v_proj")),
        (attn, ("o_proj",)),
        (mlp, ("gate_proj", "up_proj")),
        (mlp, ("down_proj",)),
    ]
    for owner, names in groups:
        why = _float_linears(owner, names)
        if why:
            return why
    return None


# --- building -------------------------------------------------------------------------------------


def fuse_linears(linears: list[nn.Linear]) -> Int8Linear:
    """One :class:`Int8Linear` over the concatenated output channels of ``linears``.

    Weights are quantized per output channel, so quantizing each layer and concatenating equals
    quantizing the concatenation; the biases are concatenated (zeros for a layer without one
    when another has one). Column ``sum(out_features[:i])`` on is layer ``i``'s output.
    """
    parts = [Int8Linear.from_float(linear) for linear in linears]
    has_bias = any(part.bias is not None for part in parts)
    first = parts[0]
    fused = Int8Linear(
        first.in_features,
        sum(part.out_features for part in parts),
        bias=has_bias,
        device=first.qweight.device,
        dtype=first.weight_scale.dtype,
    )
    fused.qweight = torch.cat([part.qweight for part in parts])  # (N, K)
    fused.weight_scale = torch.cat([part.weight_scale for part in parts])  # (N,)
    if has_bias:
        fused.bias = torch.cat(
            [
                part.bias
                if part.bias is not None
                else part.weight_scale.new_zeros(part.out_features)
                for part in parts
            ]
        )  # (N,)
    return fused


def _rewritten_for_training(module: nn.Module) -> bool:
    """Whether ``module`` is one ``apply_llmsys`` replaced or rewrote."""
    return isinstance(module, SwiGLUGatedMLP) or type(module) is not original_class(module)


def _plan_layer(layer: Any) -> Callable[[], None]:
    """Quantize ``layer``'s projections; returns a function that installs them (so a refusal
    raised while quantizing any layer leaves the model unchanged)."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    qkv = fuse_linears(projections)
    o_proj = Int8Linear.from_float(attn.o_proj)
    gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
    down = Int8Linear.from_float(mlp.down_proj)

    def install() -> None:
        del attn.q_proj, attn.k_proj, attn.v_proj
        attn.qkv_proj, attn.o_proj = qkv, o_proj
        attn.qkv_widths = [linear.out_features for linear in projections]  # q, k, v columns
        rewrite(attn, w8a8_attention_forward)
        del mlp.gate_proj, mlp.up_proj
        mlp.gate_up_proj, mlp.down_proj = gate_up, down
        rewrite(mlp, w8a8_mlp_forward)
        rewrite(layer, w8a8_decoder_layer_forward)

    return install


def quantize_model(model: nn.Module) -> dict[str, list[str]]:
    """Serve a Llama-, Mistral- or Qwen2-family model in W8A8, its decoder layers fused, in place.

    Each decoder layer of the three families (``LlamaDecoderLayer``, ``MistralDecoderLayer``,
    ``Qwen2DecoderLayer`` with their attention, gated SiLU MLP and RMSNorms) is rewritten:
    q, k and v run as one int8 GEMM over their concatenated weights (and biases), gate and up
    as another; each RMSNorm writes int8 rows and per-token scales for the GEMM after it; after
    the gate/up GEMM one row-wise kernel computes SiLU-and-mul and the per-token quantization
    for ``down_proj``. ``o_proj`` and ``down_proj`` become :class:`Int8Linear`. The scheme is
    ``quantize_linears``' (weights per output channel, activations per token), computed with
    fewer passes. The attention reads q, k and v as views of the fused GEMM's output, rotates q
    and k in one launch and keeps transformers' KV cache and masks. A model on SDPA (the
    default) whose decoder layers were all rewritten moves to ``attn_implementation=
    "llmsys_serve"``: SDPA, except that plain causal attention over a static KV cache (what
    ``generate`` serves) runs through flash-attn2: each decode step's ``decode_attention`` reads
    the cache in place, grouped-query heads natively, whatever transformers version is
    installed (``attention.static_cache_attention``). Other implementations stay as set.

    Every other plain ``nn.Linear`` is swapped for an ``Int8Linear`` as ``quantize_linears``
    swaps it: the causal LM's ``lm_head`` (as ``quantize_linears``' default does), and the
    linears of modules it does not recognise (a decoder layer of the families with another
    activation, say, or a vision tower), with a warning that lists those.

    Inference only: a rewritten layer raises ``RuntimeError`` when grad mode is on and its input
    requires grad. Its ``self_attn`` and ``mlp``, called alone, take float rows as before.

    Args:
        model: a transformers ``LlamaForCausalLM``, ``MistralForCausalLM`` or
            ``Qwen2ForCausalLM``, their base ``*Model``, or any module holding their decoder
            layers, with float16, bfloat16 or float32 weights.

    Returns:
        What was replaced (also logged at INFO by the ``llmsys.hf.quantize`` logger):
        ``"decoder_layers"``, the names of the rewritten layers; ``"linears"``, the other
        ``nn.Linear`` swapped for ``Int8Linear``; ``"fallback"``, the modules it did not
        recognise, whose linears are among ``"linears"`` (the warning's list).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a weight of a layer is not float16,
            bfloat16 or float32.
        ValueError: ``model`` is already quantized (holds an ``Int8Linear``) or rewritten by
            ``apply_llmsys``, or holds no decoder layer it can rewrite; nothing is changed then.
        ImportError: transformers is not installed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model: `model` must be an nn.Module, got {type(model).__name__}")
    named = list(model.named_modules())
    quantized = [name or type(m).__name__ for name, m in named if isinstance(m, Int8Linear)]
    if quantized:
        raise ValueError(
            f"quantize_model: `model` must not be quantized already, got {len(quantized)} "
            f"Int8Linear ({', '.join(quantized[:3])}{', ...' if len(quantized) > 3 else ''})"
        )
    trained = [name or type(m).__name__ for name, m in named if _rewritten_for_training(m)]
    if trained:
        raise ValueError(
            "quantize_model: `model` must be transformers' float model, got one rewritten by "
            f"apply_llmsys (e.g. {trained[0]!r}), whose training kernels it cannot quantize; "
            "quantize the model as transformers builds it"
        )
    for name, linear in named:  # a weight of another dtype is a TypeError, as documented
        if type(linear) is nn.Linear and linear.weight.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"quantize_model: `model` weights must be float16, bfloat16 or float32, got "
                f"{linear.weight.dtype} in {name}; nothing was changed"
            )
    classes = family_classes()
    layers, rejected = [], []
    for name, module in named:
        if type(module) in classes["decoder_layer"]:
            why = unfit_reason(module, classes)
            if why:
                rejected.append((name, module, f"{type(module).__name__}: {why}"))
            else:
                layers.append((name, module, None))
    if not layers:
        found = [f"{n} ({why})" for n, _, why in rejected] or sorted(
            {type(m).__name__ for _, m in named if "DecoderLayer" in type(m).__name__}
        )
        raise ValueError(
            "quantize_model: `model` must hold Llama-, Mistral- or Qwen2-family decoder layers "
            f"it can rewrite, got {', '.join(found) or 'none'} in {type(model).__name__}; "
            "nothing was changed (quantize_linears swaps the nn.Linear of any model)"
        )
    # The plain nn.Linear outside the layers it rewrites: lm_head, and those of the modules it
    # does not recognise (the fallback, warned about).
    inside = tuple(f"{name}." for name, _, _ in layers)
    rest = [(n, m) for n, m in named if type(m) is nn.Linear and not n.startswith(inside)]
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if output_embeddings is not None else None
    in_rejected = tuple(f"{name}." for name, _, _ in rejected)
    fallback = [(name, why) for name, _, why in rejected] + [
        (name, "an nn.Linear outside the decoder layers")
        for name, module in rest
        if module is not head and not name.startswith(in_rejected)
    ]
    installs = [_plan_layer(layer) for _, layer, _ in layers]
    for install in installs:
        install()
    config = layers[0][1].self_attn.config
    # A layer it did not rewrite keeps transformers' attention, which cannot read a static cache.
    if not rejected and config._attn_implementation == "sdpa":
        set_attn_implementation = getattr(model, "set_attn_implementation", None)
        if set_attn_implementation is not None:  # a transformers PreTrainedModel
            set_attn_implementation(register_serving_attention())
        else:
            config._attn_implementation = register_serving_attention()
    if rest:
        names = {name for name, _ in rest}
        quantize_linears(model, include=lambda name, module: name in names)
    if fallback:
        warnings.warn(
            "quantize_model: these modules are not Llama-, Mistral- or Qwen2-family decoder "
            "layers it can rewrite, so their nn.Linear were swapped for Int8Linear one by one "
            f"(quantize_linears): {'; '.join(f'{name} ({why})' for name, why in fallback)}",
            stacklevel=2,
        )
    report = {
        "decoder_layers": [name for name, _, _ in layers],
        "linears": [name for name, _ in rest],
        "fallback": [name for name, _ in fallback],
    }
    logger.info("quantize_model: %s", "; ".join(f"{k}: {len(v)}" for k, v in report.items()))
    return report
