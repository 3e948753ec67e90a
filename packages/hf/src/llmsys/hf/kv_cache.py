"""An int8 KV cache for serving (issue 46): keys and values stored as int8, one float32 scale per
(sequence, kv head, token), read by flash-attn2's decode kernel, which dequantizes on load.

    cache = Int8StaticCache(config=model.config, max_cache_len=prompt + new_tokens)
    tokens = generate(model, input_ids, new_tokens, kv_cache="int8")  # builds one itself

:class:`Int8StaticCache` is a ``transformers.StaticCache`` whose layers are
:class:`Int8StaticLayer`: half the bytes of a float16 cache, plus 4 bytes per token and head for
the scale (3% at head_dim 128). Only llmsys' attention forwards read it (``apply_llmsys``' rotary
part, ``quantize_model``; ``forwards.rotary_attention``): a forward that is plain causal
attention over the cache (the mask function's verdict, ``attention.static_cache_mask``) rotates
q and k, quantizes the new keys and values into the layer (``append_kv_int8``, at the layer's
length on the device) and reads the cache through ``decode_attention`` with the scales (at most
16 new tokens), or, for a longer prompt into an empty cache, runs ``flash_attention`` on the new
float keys and values. transformers' own attention cannot read int8 keys: the layer's
``update``, which it calls, raises a ``ValueError`` saying so, before anything is written.

This module imports transformers (the classes subclass its cache classes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import StaticCache, StaticLayer

from llmsys.flash_attn2 import append_kv_int8

from .attention import ATTN_IMPLEMENTATION, SERVING_IMPLEMENTATION
from .families import family_classes
from .forwards import rotary_attention_forward
from .quantize import w8a8_attention_forward
from .rewrite import original_class

READERS = (ATTN_IMPLEMENTATION, SERVING_IMPLEMENTATION)  # the implementations that give the verdict
_WHO_READS = (
    "only llmsys' attention forwards read it: after apply_llmsys (with its rotary part) or "
    f"quantize_model, with attn_implementation {READERS[0]!r} or {READERS[1]!r}"
)


class Int8StaticLayer(StaticLayer):
    """A ``StaticLayer`` whose keys and values are int8, ``(batch, kv_heads, max_cache_len,
    head_dim)``, with float32 scales ``k_scale`` and ``v_scale`` ``(batch, kv_heads,
    max_cache_len)``, all allocated by the first :meth:`append` (transformers' lazy
    initialization), on the new keys' device. ``cumulative_length`` is a device tensor, as in
    ``StaticLayer``, advanced in place by :meth:`append` (a CUDA graph replays it).

    Args:
        max_cache_len: the tokens each sequence can hold.
    """

    cumulative_length: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def __init__(self, max_cache_len: int, **kwargs: Any) -> None:
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.k_scale = None
        self.v_scale = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the int8 cache and its scales for keys and values shaped like
        ``key_states``, ``value_states`` ``(batch, kv_heads, tokens, head_dim)``, on their
        device (zeros; scale 0 rebuilds 0)."""
        self.device = key_states.device
        self.dtype = key_states.dtype  # the float dtype the cache stands for (5.17 sets it too)
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        rows = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros((*rows, self.k_head_dim), dtype=torch.int8, device=self.device)
        self.values = torch.zeros((*rows, self.v_head_dim), dtype=torch.int8, device=self.device)
        self.k_scale = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.v_scale = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Quantize ``key_states`` and ``value_states`` ``(batch, kv_heads, tokens, head_dim)``
        (float16, bfloat16 or float32; keys rotated) into the rows from ``cumulative_length``
        on (``append_kv_int8``: one scale per token and head), then advance
        ``cumulative_length`` in place. Nothing is read back to the host.

        Raises:
            TypeError: ``append_kv_int8``'s: a dtype it does not take.
            ValueError: ``append_kv_int8``'s: shapes that do not fit the layer, or (CPU) more
                tokens than the room left. On CUDA rows past ``max_cache_len`` are dropped.
            RuntimeError: the keys or values require grad under grad mode (inference only).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.k_scale is not None and self.v_scale is not None  # allocated with keys
        lengths = self.cumulative_length.expand(key_states.shape[0])  # the rows before
        append_kv_int8(key_states, value_states, self.keys, self.values, self.k_scale,
                       self.v_scale, lengths)  # fmt: skip
        self.cumulative_length.add_(key_states.shape[2])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refused: transformers' attention forwards call it and read the float keys and values
        it returns, which an int8 layer does not have.

        Raises:
            ValueError: always, before anything is written.
        """
        raise ValueError(
            "Int8StaticLayer.update: the int8 KV cache (llmsys.hf.kv_cache.Int8StaticCache) holds "
            "int8 keys and values with per-token scales and cannot hand float ones to "
            f"transformers' attention; {_WHO_READS}"
        )

    def reset(self) -> None:
        """Zero the cache, its scales and its length, keeping the tensors (their addresses)."""
        super().reset()
        if self.is_initialized:
            assert self.k_scale is not None and self.v_scale is not None
            self.k_scale.zero_()
            self.v_scale.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the sequences (beam search): the int8 rows and their scales alike."""
        super().reorder_cache(beam_idx)
        if self.is_initialized:
            assert self.k_scale is not None and self.v_scale is not None
            self.k_scale = self.k_scale.index_select(0, beam_idx.to(self.k_scale.device))
            self.v_scale = self.v_scale.index_select(0, beam_idx.to(self.v_scale.device))


class Int8StaticCache(StaticCache):
    """A ``transformers.StaticCache`` of :class:`Int8StaticLayer` layers: int8 keys and values,
    one float32 scale per (sequence, kv head, token). Pass it to a model whose attention is
    llmsys' (``apply_llmsys``' rotary part or ``quantize_model``) as a ``StaticCache`` is
    passed, or let ``llmsys.hf.generate(..., kv_cache="int8")`` build it.

    Args:
        config: the model's config (its text config names the layers, as ``StaticCache`` reads
            it): every layer must be a full static layer (no sliding window).
        max_cache_len: the tokens each sequence can hold, at least 1.
        offloading: must be False (an int8 layer is not offloaded).
        **kwargs: ``StaticCache``'s other keywords.

    Raises:
        TypeError: ``max_cache_len`` is not an int.
        ValueError: ``max_cache_len`` < 1, ``offloading=True``, or the config has a layer that
            is not a full static one (a sliding-window or chunked-attention layer).
    """

    layers: list[Any]

    def __init__(
        self, config: Any, max_cache_len: int, offloading: bool = False, **kwargs: Any
    ) -> None:
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int):
            got = type(max_cache_len).__name__
            raise TypeError(f"Int8StaticCache: `max_cache_len` must be an int, got {got}")
        if max_cache_len < 1:
            raise ValueError(f"Int8StaticCache: `max_cache_len` must be >= 1, got {max_cache_len}")
        if offloading:
            raise ValueError("Int8StaticCache: `offloading` must be False: int8 layers stay put")
        super().__init__(config=config, max_cache_len=max_cache_len, **kwargs)
        unfit = [(i, type(layer).__name__) for i, layer in enumerate(self.layers)
                 if type(layer) is not StaticLayer]  # fmt: skip
        if unfit:
            raise ValueError(
                "Int8StaticCache: every layer of `config` must be a full static layer "
                f"(StaticLayer); got {unfit[:4]} (sliding-window or chunked layers); use the "
                "float StaticCache for this model"
            )
        self.layers = [Int8StaticLayer(max_cache_len=max_cache_len) for _ in self.layers]


def check_int8_readers(model: nn.Module, op: str) -> None:
    """Raise unless ``model``'s attention reads an :class:`Int8StaticCache`: every Llama-,
    Mistral- or Qwen2-family attention module of it runs llmsys' forward (``apply_llmsys``'
    rotary part or ``quantize_model``'s) and its config's attention implementation is
    ``llmsys_fa2`` or ``llmsys_serve`` (whose mask functions give the static-cache verdict).

    Raises:
        ValueError: naming ``op``, the model's class and what is missing.
    """
    classes = family_classes()["attention"]
    attentions = [m for m in model.modules() if original_class(m) in classes]
    ours = (rotary_attention_forward, w8a8_attention_forward)
    stock = [m for m in attentions if getattr(type(m), "forward", None) not in ours]
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    why = None
    if not attentions:
        why = "it has no Llama-, Mistral- or Qwen2-family attention module"
    elif stock:
        why = f"{len(stock)} of its {len(attentions)} attention modules run transformers' forward"
    elif implementation not in READERS:
        why = f"its attn_implementation is {implementation!r}"
    if why:
        raise ValueError(
            f"{op}: `kv_cache='int8'` needs a model whose attention reads the int8 KV cache, got "
            f"{type(model).__name__}: {why}; {_WHO_READS}"
        )
