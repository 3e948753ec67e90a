"""The forwards ``apply_llmsys`` puts on a Llama-, Mistral- or Qwen2-family model's modules.

Each replaces one module instance's forward (``rewrite.rewrite``), so other models of the same
class in the process keep transformers' code. Each does what transformers' forward of
that module does, with an llmsys kernel where one fits, and hands every case it does not cover
to transformers' own forward of the module's class:

    RMSNorm         ``rms_norm`` (llmsys.kernels_fused); with ``residual=`` the add before it too
    decoder layer   ``float_decoder_layer_forward``: the residual add after attention fused into
                    the post-attention RMSNorm (``quantize.w8a8_decoder_layer_forward`` is the
                    int8 one)
    attention       ``rotary_attention_forward``: the q, k and v projections, then
                    ``rotary_attention``: ``rotary`` on q and k in one launch, the KV cache and
                    the attention implementation the config names (``llmsys_fa2`` after
                    ``apply_llmsys``), a static KV cache read by flash-attn2's decode kernel
                    (a decode step's rotary and append to it one ``rotary_into_cache`` launch),
                    or an int8 one (``kv_cache.Int8StaticCache``) read with its scales;
                    the W8A8 attention calls ``rotary_attention`` with the three column ranges
                    of its fused q|k|v projection
    causal LM       with ``labels=``, the loss from the last hidden states through
                    ``causal_lm_loss`` (the logits never exist); without labels, or with
                    ``logits_to_keep``: transformers' forward
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmsys.kernels_fused import causal_lm_loss, rms_norm, rotary, rotary_into_cache

from .attention import (
    appendable_static_layer,
    int8_cache_attention,
    is_static_cache_mask,
    static_cache_attention,
    static_layer_decode,
)
from .rewrite import original_class


def rms_norm_forward(
    self: Any, hidden_states: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``LlamaRMSNorm.forward``; with ``residual``, returns ``(norm(hidden + residual), sum)``."""
    return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual=residual)


def float_decoder_layer_forward(
    self: Any, hidden_states: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` with the add after attention fused into the next norm.

    The keyword arguments go to the attention as transformers' layer passes them. The add after
    the MLP stays a plain add: the next layer receives one tensor, as transformers' model loop
    hands it over. (``quantize.w8a8_decoder_layer_forward`` is the W8A8 one.)"""
    residual = hidden_states
    hidden_states = _cast_once(self.input_layernorm(hidden_states))
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    # The stream first: the sum takes its dtype (float32 under autocast, as stock's add).
    hidden_states, residual = self.post_attention_layernorm(residual, residual=hidden_states)
    return residual + self.mlp(_cast_once(hidden_states))


def _cast_once(normed: torch.Tensor) -> torch.Tensor:
    """A norm's float32 output in autocast's dtype, where autocast is on for its device.

    Autocast would cast it for each linear that reads it, and each of those saves its own copy
    for backward: q, k and v three, gate and up two, N x hidden 16-bit values each. Cast once,
    they share one (the values are the same: autocast's cast of the same tensor). Backward then
    sums their three input gradients in that dtype, where stock sums them in float32."""
    device = normed.device.type
    if normed.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return normed.to(torch.get_autocast_dtype(device))
    return normed


def full_width_rotary(config: Any) -> bool:
    """Whether a model of ``config`` rotates every channel of a head (no
    ``partial_rotary_factor``): the case the fused ``rotary`` kernel fits."""
    return getattr(config, "partial_rotary_factor", 1.0) == 1.0


def _interface(module: Any) -> Callable[..., Any]:
    """The attention function ``config._attn_implementation`` names, as transformers picks it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.config._attn_implementation
    if name in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def rotary_attention(
    attn: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Llama-, Mistral- or Qwen2-family attention ``attn`` from its projections' outputs:
    rotary embeddings, KV cache, the configured attention implementation, ``o_proj``.

    ``query`` is (batch, tokens, heads x head_dim), ``key`` and ``value`` (batch, tokens,
    kv_heads x head_dim); views into one wider tensor (a fused projection's columns) are read
    in place. q and k rotate in one ``rotary`` launch where the rotary embeddings are
    full-width, by the family's own ``apply_rotary_pos_emb`` otherwise. A KV cache is updated as
    transformers does it: ``cache.update(..., kwargs=kwargs)`` where the layer passes ``cache=``
    (transformers 5.2x), ``past_key_values.update(...)`` where it passes ``past_key_values=``
    (5.17). Where the mask function found plain causal attention over a static KV cache
    (``attention.static_cache_mask``: ``llmsys_fa2`` and ``llmsys_serve`` give it), the
    attention reads that cache through flash-attn2 (``attention.static_cache_attention``); else
    it is the configured implementation's. A decode step of that kind (at most 16 new tokens,
    full-width rotary, no gradient) over transformers' own ``StaticLayer``, allocated and not
    offloaded (``attention.appendable_static_layer``), skips ``cache.update``: one
    ``rotary_into_cache`` launch rotates q, rotates k into the cache and copies v there, the
    layer's length advances in place as ``StaticLayer.update`` advances it, and
    ``decode_attention`` reads the cache (``attention.static_layer_decode``). Over an int8 KV
    cache (``kv_cache.Int8StaticCache``) the forward never calls ``cache.update``: q and k
    rotate, the new keys and values are quantized into the layer and the cache is read with
    its scales (``attention.int8_cache_attention``, which refuses any forward that is not the
    static-cache verdict). Returns ``(output, attention weights or None)`` as transformers'
    attention does."""
    cache = kwargs.pop("cache", None)
    legacy_cache = kwargs.pop("past_key_values", None)
    input_shape = query.shape[:-1]
    hidden_shape = (*input_shape, -1, attn.head_dim)
    query = query.view(hidden_shape).transpose(1, 2)  # (B, H, N, d)
    key = key.view(hidden_shape).transpose(1, 2)  # (B, H_kv, N, d)
    value = value.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    the_cache = cache if cache is not None else legacy_cache
    full_width = full_width_rotary(attn.config)
    int8_layer = int8_cache_layer(attn, the_cache)
    if int8_layer is not None:
        # An int8 KV cache: rotary, then the quantized append and the attention over it.
        query, key = _rotate(attn, query, key, cos, sin, full_width)
        output = int8_cache_attention(attn, query, key, value, attention_mask, int8_layer)
        return attn.o_proj(output.reshape(*input_shape, -1).contiguous()), None
    layer = None
    if full_width and not _grad_wanted(query, key, value, cos, sin):
        layer = appendable_static_layer(attn, key, attention_mask, the_cache)
    if layer is not None:
        # A decode step over a static cache: q rotated, k rotated into the cache and v copied
        # there in one launch (rotary, then StaticLayer.update), then decode over the cache.
        lengths = layer.cumulative_length.expand(key.shape[0])  # the rows before the append
        query = rotary_into_cache(query, key, value, cos, sin, layer.keys, layer.values, lengths)
        layer.cumulative_length.add_(key.shape[2])  # in place, as StaticLayer.update counts
        output = static_layer_decode(attn, query, layer)
        return attn.o_proj(output.reshape(*input_shape, -1).contiguous()), None
    query, key = _rotate(attn, query, key, cos, sin, full_width)
    new_key, new_value = key, value
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
    elif legacy_cache is not None:
        key, value = legacy_cache.update(key, value, attn.layer_idx)
    if is_static_cache_mask(attention_mask):  # the mask function's verdict: plain causal
        output = static_cache_attention(attn, query, new_key, new_value, key, value, the_cache)
        weights = None
    else:
        # Qwen2 keeps its window per layer, Mistral in the config, Llama has none.
        window = getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))
        output, weights = _interface(attn)(
            attn,
            query,
            key,
            value,
            attention_mask,
            dropout=attn.attention_dropout if attn.training else 0.0,
            scaling=attn.scaling,
            sliding_window=window,
            **kwargs,
        )
    output = output.reshape(*input_shape, -1).contiguous()
    return attn.o_proj(output), weights


def _rotate(
    attn: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    full_width: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated: in one ``rotary`` launch where the rotary is full-width, else by the
    family's own ``apply_rotary_pos_emb``."""
    if full_width:
        return rotary(query, key, cos, sin)
    family = sys.modules[type(attn).__module__]
    return family.apply_rotary_pos_emb(query, key, cos, sin)


def int8_cache_layer(attn: Any, cache: Any) -> Any | None:
    """The layer of ``cache`` for ``attn`` if it is an int8 one (``kv_cache.Int8StaticLayer``),
    else None."""
    layers = getattr(cache, "layers", None)
    if not layers or attn.layer_idx >= len(layers):
        return None
    from .kv_cache import Int8StaticLayer  # imports transformers: only once a cache is here

    layer = layers[attn.layer_idx]
    return layer if isinstance(layer, Int8StaticLayer) else None


def _grad_wanted(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def rotary_attention_forward(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``LlamaAttention.forward`` (and Mistral's and Qwen2's) with q and k rotated in one launch:
    the three projections of ``hidden_states``, then :func:`rotary_attention`."""
    assert position_embeddings is not None  # (None only in the signature: layers pass them)
    return rotary_attention(
        self,
        self.q_proj(hidden_states),
        self.k_proj(hidden_states),
        self.v_proj(hidden_states),
        position_embeddings,
        attention_mask,
        **kwargs,
    )


def _output_with_cache(outputs: Any, **fields: Any) -> Any:
    """A ``CausalLMOutputWithPast`` carrying ``outputs``' cache under the field name of the
    installed transformers (``cache`` from 5.2x, ``past_key_values`` before)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    for name in ("cache", "past_key_values"):
        if name in CausalLMOutputWithPast.__dataclass_fields__:
            fields[name] = getattr(outputs, name, None)
            break
    return CausalLMOutputWithPast(**fields)


def causal_lm_forward(
    self: Any,
    input_ids: torch.Tensor | None = None,
    *args: Any,
    labels: torch.Tensor | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Any,
) -> Any:
    """``LlamaForCausalLM.forward`` whose loss never materialises the logits.

    With ``labels`` (and no ``logits_to_keep``), the loss comes from the last hidden states
    and ``lm_head``'s weight through ``causal_lm_loss``, as transformers' ``ForCausalLMLoss``
    defines it (shifted labels, ``ignore_index=-100``, ``num_items_in_batch``), and ``logits`` is
    ``None``. Anything else (no labels, ``logits_to_keep``, an ``lm_head`` that is no longer an
    ``nn.Linear``, as after int8 quantization) runs the class's own forward.
    """
    head = self.lm_head
    keep_all = isinstance(logits_to_keep, int) and logits_to_keep == 0
    if labels is None or not keep_all or args or type(head) is not nn.Linear:
        return original_class(self).forward(
            self, input_ids, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs
        )
    loss_kwargs = {
        name: kwargs.pop(name)
        for name in ("num_items_in_batch", "ignore_index", "shift_labels")
        if name in kwargs
    }
    return_dict = kwargs.pop("return_dict", None)
    outputs = self.model(input_ids, return_dict=True, **kwargs)
    # lm_head's weight read outside lm_head: its input in the weight's dtype, as lm_head would
    # take it (FSDP's compute_dtype casts the weight; a float32 norm gain leaves float32 states)
    hidden = outputs.last_hidden_state.to(head.weight.dtype)
    loss = causal_lm_loss(hidden, head.weight, labels, lm_head_bias=head.bias, **loss_kwargs)
    output = _output_with_cache(
        outputs,
        loss=loss,
        logits=None,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return output if return_dict else output.to_tuple()
