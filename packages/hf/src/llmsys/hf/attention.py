"""llmsys' ``flash_attention`` as a Hugging Face transformers attention implementation.

    from llmsys.hf import register_flash_attention

    register_flash_attention()  # once per process, before the model is built
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="llmsys_fa2")

``register_flash_attention()`` adds two entries under the name ``"llmsys_fa2"``: the attention
function :func:`flash_attention_interface` to transformers' ``AttentionInterface`` and the mask
function :func:`causal_mask` to its ``AttentionMaskInterface``.
The mask function is what keeps padding from being silently ignored: without one, transformers
builds no mask at all for a custom implementation.

What runs: causal attention, top-left aligned, grouped-query heads read in place (the
``(B, H_kv, N, d)`` keys and values go to the kernel as they are, no ``repeat_kv`` copy). That is
exact for a whole sequence at once (training, prefill into an empty cache) and for one new token
over a ``DynamicCache`` (decoding). Everything else needs a mask the kernel cannot apply, so it
raises a ``ValueError`` saying which case it is and what to do: a padded ``attention_mask``, packed
sequences, a static KV cache read by transformers' own attention forward (see below), several new
tokens over a non-empty ``DynamicCache``, a sliding window or attention chunk shorter than the
sequence, attention dropout, logit soft-capping, attention sinks, or a ready-made 4-D mask.
transformers is imported only when a ``register_*`` function runs.

A static KV cache (``StaticCache``, which ``llmsys.hf.generate`` fills) offers all its slots,
filled or not, so attention over it needs each sequence's length. Where a forward over one is
plain causal attention over the cache's first slots (no padding, no dropped tokens, no window
shorter than the cache, at most 16 new tokens unless the cache is empty), the mask function
says so by returning :func:`static_cache_mask`: an empty ``(batch, 1, q_len, 0)`` tensor, which
transformers hands to every layer unchanged (its ``generate`` even builds it ahead of the
forward) and which no real mask is (no keys). The attention forward of ``apply_llmsys`` (its
rotary part) and of ``quantize_model`` serves it (:func:`static_cache_attention`): at most 16
new tokens through ``decode_attention``, reading the cache's own tensors in place with the
cache's length on the device (no host sync: a CUDA graph replays it), more (a prompt into an
empty cache) through ``flash_attention`` on the new keys and values. Where the cache and its
layer are transformers' own (``Cache.update``, ``StaticLayer.update``, allocated, not
offloading), such a step of at most 16 tokens skips ``cache.update``: the rotary kernel writes
the new keys and values into the layer itself (``llmsys.kernels_fused.rotary_into_cache``,
:func:`appendable_static_layer`) and the forward advances the layer's length as ``update``
would. transformers' own attention forward hands the verdict to the attention function, which
refuses it: it cannot know the lengths.

``"llmsys_serve"`` (:func:`register_serving_attention`; ``quantize_model`` sets it) is SDPA but
for that verdict: a forward over a static cache that is plain causal attention goes through
flash-attn2 as above, every other one gets SDPA's mask and SDPA, padding included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmsys.flash_attn2 import decode_attention, flash_attention
from llmsys.flash_attn2.decode import MAX_Q_LEN

# Not "llmsys_flash_attn2" or "..._sdpa": transformers takes a name containing "flash" for a
# FlashAttention varlen kernel and tries to load it, and one containing "sdpa" for its SDPA.
ATTN_IMPLEMENTATION = "llmsys_fa2"
SERVING_IMPLEMENTATION = "llmsys_serve"
_FALLBACK = "use attn_implementation='sdpa' for such inputs"


def register_flash_attention() -> str:
    """Register ``"llmsys_fa2"`` with transformers (idempotent); returns the name.

    Raises:
        ImportError: transformers is not installed (``pip install llmsys-hf``).
    """
    return _register(ATTN_IMPLEMENTATION, flash_attention_interface, causal_mask)


def register_serving_attention() -> str:
    """Register ``"llmsys_serve"`` with transformers (idempotent); returns the name: SDPA, except
    that plain causal attention over a static KV cache goes through flash-attn2 in llmsys'
    attention forwards (the module docstring says how).

    Raises:
        ImportError: transformers is not installed (``pip install llmsys-hf``).
    """
    return _register(SERVING_IMPLEMENTATION, serving_attention_interface, serving_mask)


def _register(name: str, attention: Callable[..., Any], mask: Callable[..., Any]) -> str:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError("llmsys.hf needs transformers: pip install llmsys-hf") from error
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


def _refuse(what: str, implementation: str = ATTN_IMPLEMENTATION) -> ValueError:
    return ValueError(f"attn_implementation='{implementation}': {what}; {_FALLBACK}")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def causal_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    local_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask function for this implementation: None where plain causal attention is
    exact, :func:`static_cache_mask` where it is exact over a static KV cache's first slots,
    else a ``ValueError``. Called by the model's ``create_*_mask`` once per forward, with the
    sizes of the call (``q_offset``: tokens already cached; ``kv_length``: keys attended)."""
    if _over_a_static_cache(q_length, kv_length, q_offset, kv_offset):
        why = _static_cache_refusal(
            batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
            allow_is_causal_skip, local_size, kwargs,
        )  # fmt: skip
        if why:
            raise _refuse(why)
        return static_cache_mask(batch_size, q_length, kwargs.get("device"))
    seen = q_offset + q_length  # tokens of the sequence so far, these queries included
    if kv_offset != 0 or kv_length != seen:
        raise _refuse(
            f"the {kv_length} keys from position {kv_offset} are not the whole sequence so far "
            f"({seen} tokens), as with a sliding-window cache that has dropped tokens"
        )
    if q_offset > 0 and q_length > 1:
        raise _refuse(
            f"{q_length} new tokens over {q_offset} cached ones (chunked prefill, assisted "
            "decoding) need a bottom-right causal mask; the kernel's is top-left"
        )
    if local_size is not None and seen > local_size:
        raise _refuse(
            f"a sliding window or attention chunk of {local_size} tokens is shorter than the "
            f"sequence ({seen} tokens)"
        )
    pattern = (batch_size, q_length, kv_length, q_offset, kv_offset, kwargs.get("device"))
    why = (
        None if allow_is_causal_skip else _pattern_refusal(kwargs.get("mask_function"), pattern)
    ) or _padding_refusal(attention_mask)
    if why:
        raise _refuse(why)
    return None


def serving_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    allow_is_causal_skip: bool = True,
    local_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """transformers' mask function for ``"llmsys_serve"``: :func:`static_cache_mask` where a
    forward over a static KV cache is plain causal attention over its first slots, else SDPA's
    own mask (padding, chunked prefill, a sliding window: served by SDPA as before)."""
    if _over_a_static_cache(q_length, kv_length, q_offset, kv_offset):
        why = _static_cache_refusal(
            batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
            allow_is_causal_skip, local_size, kwargs,
        )  # fmt: skip
        if not why:
            return static_cache_mask(batch_size, q_length, kwargs.get("device"))
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](
        batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
        allow_is_causal_skip=allow_is_causal_skip, local_size=local_size, **kwargs,
    )  # fmt: skip


def static_cache_mask(
    batch_size: int, q_length: int, device: torch.types.Device = None
) -> torch.Tensor:
    """The mask functions' verdict "plain causal attention over a static KV cache's first
    slots": an empty ``(batch_size, 1, q_length, 0)`` tensor (a mask over no keys)."""
    return torch.empty((batch_size, 1, q_length, 0), dtype=torch.bool, device=device)


def is_static_cache_mask(attention_mask: object) -> bool:
    """Whether ``attention_mask`` is :func:`static_cache_mask`'s verdict."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 4
        and attention_mask.shape[-1] == 0
    )


def _over_a_static_cache(
    q_length: int, kv_length: int, q_offset: int | torch.Tensor, kv_offset: int
) -> bool:
    """Whether transformers sized this forward's mask for a static KV cache: one that counts its
    tokens on the device (a tensor offset), or offers more slots than the tokens so far."""
    return isinstance(q_offset, torch.Tensor) or (
        kv_offset == 0 and kv_length > q_offset + q_length
    )


def _static_cache_refusal(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor,
    kv_offset: int,
    attention_mask: torch.Tensor | None,
    allow_is_causal_skip: bool,
    local_size: int | None,
    kwargs: dict[str, Any],
) -> str | None:
    """Why a forward over a static KV cache is not plain causal attention over the cache's first
    slots, the case :func:`static_cache_attention` computes from the cache's lengths; None if
    it is. Reads nothing from the device on a decode step (at most 16 new tokens, no
    ``attention_mask``)."""
    if kv_offset != 0:
        return (
            f"the {kv_length} keys of the static KV cache start at position {kv_offset}: a "
            "sliding-window layer has dropped tokens"
        )
    if local_size is not None and kv_length > local_size:
        return (
            f"a sliding window or attention chunk of {local_size} tokens is shorter than the "
            f"static KV cache ({kv_length} slots)"
        )
    if q_length > MAX_Q_LEN:  # served by flash_attention on the new tokens alone
        cached = q_offset
        if isinstance(q_offset, torch.Tensor):
            if _capturing():
                return (
                    f"under CUDA-graph capture, {q_length} new tokens over a static KV cache: "
                    f"whether it is empty cannot be checked there (at most {MAX_Q_LEN} new tokens)"
                )
            cached = int(q_offset)  # one host sync per forward, for a prompt
        if cached:
            return (
                f"{q_length} new tokens over {cached} cached ones in a static KV cache: at most "
                f"{MAX_Q_LEN} new tokens over a non-empty cache"
            )
    mask_function = kwargs.get("mask_function")
    # With a cache transformers packs no sequences, and turns allow_is_causal_skip off for a
    # static cache's one-token steps: the pattern is its causal one, or its sliding-window one
    # (causal here: the window covers the cache), unless an overlay was added (use_vmap).
    from transformers.masking_utils import causal_mask_function

    causal = mask_function is causal_mask_function or (
        local_size is not None and not kwargs.get("use_vmap", False)
    )
    pattern = (batch_size, q_length, kv_length, q_offset, kv_offset, kwargs.get("device"))
    if not (allow_is_causal_skip or causal):
        why = _pattern_refusal(mask_function, pattern)
        if why:
            return why
    return _padding_refusal(attention_mask)


def _pattern_refusal(
    mask_function: Callable[..., torch.Tensor] | None, pattern: tuple
) -> str | None:
    """Why transformers' composed mask pattern (packed sequences, a custom or bidirectional
    mask; or packing not ruled out while tracing) is not plain causal; None if it is."""
    if _capturing():
        return (
            "under CUDA-graph capture transformers cannot rule out packed sequences (its check "
            "reads position_ids), and neither can this check; capture with sdpa"
        )
    if not _is_plain_causal(mask_function, *pattern):
        return (
            "this forward needs an explicit mask (packed sequences in position_ids, a "
            "bidirectional or custom mask pattern); only plain causal attention is supported"
        )
    return None


def _padding_refusal(attention_mask: torch.Tensor | None) -> str | None:
    """Why transformers' 2-D padding mask (as booleans) masks something; None if it does not."""
    if attention_mask is None:
        return None
    if _capturing():
        return (
            "under CUDA-graph capture pass attention_mask=None: whether it pads cannot be checked "
            "there"
        )
    if not bool(attention_mask.all()):  # under torch.compile: a graph break
        return (
            "attention_mask has padded positions (zeros); padding is not supported, so batch "
            "sequences of equal length or pass attention_mask=None"
        )
    return None


def _is_plain_causal(
    mask_function: Callable[..., torch.Tensor] | None,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    device: torch.types.Device,
) -> bool:
    """Whether transformers' index-based ``mask_function(batch, head, q, kv) -> bool`` allows
    exactly ``kv <= q`` at every position of this call. Reads a device tensor: under
    torch.compile this is a graph break (one per forward, not per layer)."""
    if mask_function is None:
        return False
    q = torch.arange(q_length, device=device) + q_offset
    kv = torch.arange(kv_length, device=device) + kv_offset
    batch = torch.arange(batch_size, device=device)
    head = torch.zeros(1, dtype=torch.long, device=device)
    try:
        allowed = mask_function(batch[:, None, None, None], head[None, :, None, None],
                                q[None, None, :, None], kv[None, None, None, :])  # fmt: skip
    except Exception:  # a pattern that is not index-based: treat it as not causal
        return False
    causal = kv[None, None, None, :] <= q[None, None, :, None]
    return bool(torch.equal(allowed.expand(batch_size, 1, q_length, kv_length), causal.expand(
        batch_size, 1, q_length, kv_length)))  # fmt: skip


def flash_attention_interface(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over :func:`flash_attention`.

    Args:
        module: the calling attention layer (its ``is_causal``, default True, is used unless
            ``is_causal`` is given).
        query: ``(B, H, N_q, d)``.
        key, value: ``(B, H_kv, N_k, d)``, ``H_kv`` dividing ``H``; read in place.
        attention_mask: must be None (the registered mask function returns None wherever plain
            causal attention is exact and raises elsewhere); its static-cache verdict
            (:func:`static_cache_mask`) is refused: llmsys' attention forwards serve that case
            before calling this function, transformers' forwards cannot.
        dropout: must be 0 (the kernel has no dropout).
        scaling: the score scale (default ``1 / sqrt(d)``).
        sliding_window: at least ``N_k`` if given (else the window would mask keys).
        softcap: must be None.

    Under ``torch.autocast`` the three are cast to the autocast dtype first, as SDPA does.

    Returns:
        ``(output, None)``: output ``(B, N_q, H, d)`` contiguous; no attention weights.
    """
    if is_static_cache_mask(attention_mask):
        raise _static_cache_unserved(module)
    if attention_mask is not None:
        raise _refuse(
            f"got an explicit attention mask of shape {tuple(attention_mask.shape)}; only plain "
            "causal attention is supported (is the model's mask built by transformers' "
            "masking_utils, and this implementation registered?)"
        )
    if dropout:
        raise _refuse(f"attention dropout {dropout} is not supported (set attention_dropout=0)")
    if softcap is not None:
        raise _refuse(f"logit soft-capping (softcap={softcap}) is not supported")
    if kwargs.get("s_aux") is not None:
        raise _refuse("attention sinks (s_aux) are not supported")
    if sliding_window is not None and key.shape[2] > sliding_window:
        raise _refuse(
            f"a sliding window of {sliding_window} tokens is shorter than the {key.shape[2]} keys"
        )
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # One query over the whole cache sees every key: no mask. Several queries: the mask function
    # has checked that they start the sequence, where top-left and bottom-right alignment agree.
    causal = bool(is_causal) and query.shape[2] > 1
    if causal and key.shape[2] != query.shape[2]:
        raise _refuse(
            f"{query.shape[2]} queries over {key.shape[2]} keys need a bottom-right causal mask"
        )
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as SDPA under autocast: one low-precision dtype
        dtype = torch.get_autocast_dtype(device_type)  # (rotary embeddings leave q, k in fp32)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = flash_attention(query, key, value, causal=causal, scale=scaling)  # (B, H, N_q, d)
    return out.transpose(1, 2).contiguous(), None


def serving_attention_interface(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> Any:
    """transformers' attention-function signature for ``"llmsys_serve"``: SDPA (transformers'
    own function, with the mask :func:`serving_mask` built); the static-cache verdict, which
    llmsys' attention forwards serve before calling this, is refused."""
    if is_static_cache_mask(attention_mask):
        raise _static_cache_unserved(module)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _static_cache_unserved(module: Any) -> ValueError:
    return _refuse(
        f"a static KV cache (StaticCache, cache_implementation='static') has unfilled slots, and "
        f"this {type(module).__name__} runs transformers' attention forward, which cannot tell "
        "this function the cache's lengths (the forwards of apply_llmsys' rotary part and of "
        "quantize_model can)",
        module.config._attn_implementation,
    )


def static_cache_attention(
    module: Any,
    query: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cache: Any,
) -> torch.Tensor:
    """Attention over a static KV cache, given the mask function's verdict that this forward is
    plain causal attention over the cache's first slots (:func:`static_cache_mask`).

    Args:
        module: the attention layer (``layer_idx``, ``scaling``, ``attention_dropout``).
        query: ``(B, H, N, d)``, rotated.
        new_key, new_value: ``(B, H_kv, N, d)``, the N new tokens' keys (rotated) and values.
        keys, values: what ``cache.update(new_key, new_value, ...)`` returned: the cache layer's
            own ``(B, H_kv, capacity, d)`` buffers, the new tokens written after the cached ones.
        cache: the ``StaticCache``; its layer counts its tokens on the device.

    At most 16 new tokens (a decode step, a speculative or chunked one, a short prompt):
    ``decode_attention`` reads ``keys`` and ``values`` in place with the layer's length, new
    tokens included, as each sequence's (no host sync). More: a prompt into an empty cache (the
    mask function checked), so ``flash_attention`` (causal) on the new keys and values alone.

    Returns:
        ``(B, N, H, d)``, contiguous, as transformers' attention functions return it.
    """
    layers = getattr(cache, "layers", ())
    layer: Any = layers[module.layer_idx] if module.layer_idx < len(layers) else None
    if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor) or (
        getattr(layer, "keys", None) is not keys
    ):
        raise _refuse(
            "the mask sizes say a static KV cache, but the cache's layer "
            f"{module.layer_idx} ({type(layer).__name__}) did not hand back its own buffers "
            "with a length on the device",
            module.config._attn_implementation,
        )
    if module.training and module.attention_dropout:
        raise _refuse(
            f"attention dropout {module.attention_dropout} is not supported (set "
            "attention_dropout=0)",
            module.config._attn_implementation,
        )
    if query.shape[2] <= MAX_Q_LEN:
        return static_layer_decode(module, query, layer)
    out = flash_attention(query, new_key, new_value, causal=True, scale=module.scaling)
    return out.transpose(1, 2).contiguous()


def static_layer_decode(module: Any, query: torch.Tensor, layer: Any) -> torch.Tensor:
    """``decode_attention`` of ``query`` ``(B, H, N, d)`` (at most 16 new tokens, already in the
    cache) over a static cache layer's own buffers, in place, with the layer's length on the
    device as each sequence's: ``(B, N, H, d)``, contiguous. An int8 layer
    (``kv_cache.Int8StaticLayer``) hands its scales too, and the kernel dequantizes on load."""
    lengths = layer.cumulative_length.expand(query.shape[0])  # one for every sequence
    scales = {}
    if layer.keys.dtype == torch.int8:
        scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
    out = decode_attention(
        query, layer.keys, layer.values, lengths, sm_scale=module.scaling, **scales
    )
    return out.transpose(1, 2).contiguous()


def int8_cache_attention(
    module: Any,
    query: torch.Tensor,
    new_key: torch.Tensor,
    new_value: torch.Tensor,
    attention_mask: object,
    layer: Any,
) -> torch.Tensor:
    """Attention over an int8 KV cache layer (``kv_cache.Int8StaticLayer``), which only this
    reads: the new keys and values quantized into it (``layer.append``: ``append_kv_int8`` at
    the layer's length, then the length advanced in place), then at most 16 new tokens through
    ``decode_attention`` over the int8 cache with its scales and the layer's length on the
    device (no host sync: a CUDA graph replays it), or a longer prompt (into an empty cache:
    the mask function checked) through causal ``flash_attention`` on the new float keys and
    values.

    Args:
        module: the attention layer (``scaling``, ``attention_dropout``, ``config``).
        query: ``(B, H, N, d)``, rotated.
        new_key, new_value: ``(B, H_kv, N, d)``, the new tokens' keys (rotated) and values.
        attention_mask: what the mask function returned: the static-cache verdict
            (:func:`static_cache_mask`), plain causal attention over the cache's first slots,
            or None from ``llmsys_fa2``'s or ``llmsys_serve``'s mask function, which says that
            causal attention over every slot is exact (a forward that fills the cache to its
            last slot; more than 16 such tokens only into an empty cache).
        layer: the ``Int8StaticLayer`` of ``module``'s layer index.

    Returns:
        ``(B, N, H, d)``, contiguous, as transformers' attention functions return it.

    Raises:
        ValueError: ``attention_mask`` is not the verdict (padding, a chunk of more than 16 new
            tokens over cached ones, a window shorter than the cache, or an attention
            implementation other than ``llmsys_fa2`` / ``llmsys_serve``), or attention dropout
            is on; before the cache is written.
    """
    implementation = module.config._attn_implementation
    readers = (ATTN_IMPLEMENTATION, SERVING_IMPLEMENTATION)
    whole = attention_mask is None and implementation in readers
    if not (whole or is_static_cache_mask(attention_mask)):
        raise ValueError(
            f"the int8 KV cache (Int8StaticCache) is read only as plain causal attention over "
            f"its first slots, which attn_implementation {implementation!r} did not find for "
            "this forward (llmsys_fa2 and llmsys_serve find it where there is no padding, at "
            f"most {MAX_Q_LEN} new tokens over cached ones and no window shorter than the "
            "cache); use the float cache for such inputs"
        )
    if module.training and module.attention_dropout:
        raise ValueError(
            f"the int8 KV cache (Int8StaticCache): attention dropout {module.attention_dropout} "
            "is not supported (set attention_dropout=0, or call model.eval())"
        )
    layer.append(new_key, new_value)
    if query.shape[2] <= MAX_Q_LEN:
        return static_layer_decode(module, query, layer)
    out = flash_attention(query, new_key, new_value, causal=True, scale=module.scaling)
    return out.transpose(1, 2).contiguous()


def appendable_static_layer(
    module: Any, key: torch.Tensor, attention_mask: object, cache: Any
) -> Any | None:
    """The layer of ``cache`` that the new keys and values of ``module``'s forward can be
    written to by the rotary kernel itself (``llmsys.kernels_fused.rotary_into_cache``) in place
    of ``cache.update``, or None where they go through ``cache.update``.

    That is transformers' ``StaticLayer.update`` done in the kernel: the rows from the layer's
    ``cumulative_length`` on, which its caller then advances in place as ``update`` does. So it
    needs the mask function's verdict (:func:`static_cache_mask`) for at most 16 new tokens
    (decoded in place after), a cache and a layer whose ``update`` is transformers' own
    ``Cache.update`` and ``StaticLayer.update`` (not a sliding-window or quantized layer, nor a
    subclass that adds to them), no offloading (``Cache.update`` moves layers then), a layer
    already allocated (by its first ``update``) in ``key``'s dtype, and no attention dropout
    (which :func:`static_cache_attention` refuses)."""
    if not is_static_cache_mask(attention_mask) or key.shape[2] > MAX_Q_LEN:
        return None
    from transformers.cache_utils import Cache, StaticLayer

    layers = getattr(cache, "layers", ())
    if (
        getattr(type(cache), "update", None) is not Cache.update
        or getattr(cache, "offloading", True)
        or module.layer_idx >= len(layers)
        or (module.training and module.attention_dropout)
    ):
        return None
    layer = layers[module.layer_idx]
    if getattr(type(layer), "update", None) is not StaticLayer.update or not layer.is_initialized:
        return None
    return layer if layer.keys.dtype == key.dtype else None
