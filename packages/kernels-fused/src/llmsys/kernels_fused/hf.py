"""A Hugging Face attention forward with q and k rotated by :func:`rotary` in one launch.

``attention_forward`` is ``LlamaAttention.forward`` (Mistral's and Qwen2's are the same) with
``apply_rotary_pos_emb``'s five eager kernels per tensor replaced by one launch for q and k.
Whoever rewrites a model binds it to one attention instance (``attn.forward =
MethodType(attention_forward, attn)``), so other models of the class in the process keep
transformers' code: ``llmsys.hf.apply_llmsys`` for training and kernels-int8's
``quantize_model`` for serving. It fits full-width rotary embeddings only (no
``partial_rotary_factor``); transformers is imported only when it runs.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .rotary import rotary


def fits(config) -> bool:
    """Whether ``attention_forward`` fits a model of ``config``: full-width rotary embeddings."""
    return getattr(config, "partial_rotary_factor", 1.0) == 1.0


def _interface(module: nn.Module):
    """The attention function ``config._attn_implementation`` names, as transformers picks it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.config._attn_implementation
    if name in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """``LlamaAttention.forward`` (and Mistral's and Qwen2's) with the fused rotary kernel.

    A KV cache is updated as transformers does it: ``cache.update(..., kwargs=kwargs)`` where
    the layer passes ``cache=`` (transformers 5.2x), ``past_key_values.update(...)`` where it
    passes ``past_key_values=`` (5.17)."""
    cache = kwargs.pop("cache", None)
    legacy_cache = kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = rotary(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    elif legacy_cache is not None:
        key, value = legacy_cache.update(key, value, self.layer_idx)
    # Qwen2 keeps its window per layer, Mistral in the config, Llama has none.
    window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    output, weights = _interface(self)(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=self.attention_dropout if self.training else 0.0,
        scaling=self.scaling,
        sliding_window=window,
        **kwargs,
    )
    output = output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(output), weights
