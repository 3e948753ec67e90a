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
sequences, a static KV cache, several new tokens over a non-empty cache, a sliding window or
attention chunk shorter than the sequence, attention dropout, logit soft-capping, attention sinks,
or a ready-made 4-D mask. transformers is imported only when ``register_flash_attention`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from llmsys.flash_attn2 import flash_attention

# Not "llmsys_flash_attn2": transformers takes any name containing "flash" for a FlashAttention
# varlen kernel and tries to load it as one.
ATTN_IMPLEMENTATION = "llmsys_fa2"
_FALLBACK = "use attn_implementation='sdpa' for such inputs"


def register_flash_attention() -> str:
    """Register ``"llmsys_fa2"`` with transformers (idempotent); returns the name.

    Raises:
        ImportError: transformers is not installed (``pip install llmsys-hf``).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError("llmsys.hf needs transformers: pip install llmsys-hf") from error
    AttentionInterface.register(ATTN_IMPLEMENTATION, flash_attention_interface)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, causal_mask)
    return ATTN_IMPLEMENTATION


def _refuse(what: str) -> ValueError:
    return ValueError(f"attn_implementation='{ATTN_IMPLEMENTATION}': {what}; {_FALLBACK}")


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
) -> None:
    """transformers' mask function for this implementation: None where plain causal attention is
    exact, else a ``ValueError``. Called by the model's ``create_*_mask`` once per forward, with
    the sizes of the call (``q_offset``: tokens already cached; ``kv_length``: keys attended)."""
    seen = q_offset + q_length  # tokens of the sequence so far, these queries included
    # StaticCache counts its tokens on the device (a tensor offset) and hands out all its slots
    if isinstance(q_offset, torch.Tensor) or (kv_offset == 0 and kv_length > seen):
        raise _refuse(
            f"{kv_length} keys for {seen} tokens: a static KV cache (StaticCache, "
            "cache_implementation='static') has unfilled slots that need a mask (use the "
            "default DynamicCache), and cross-attention is not causal"
        )
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
    if not allow_is_causal_skip:
        # transformers composed a pattern (packed sequences, a custom or bidirectional mask), or
        # could not rule packing out because it is tracing: is the pattern still plain causal?
        if _capturing():
            raise _refuse(
                "under CUDA-graph capture transformers cannot rule out packed sequences (its "
                "check reads position_ids), and neither can this check; capture with sdpa"
            )
        pattern = (batch_size, q_length, kv_length, q_offset, kv_offset, kwargs.get("device"))
        if not _is_plain_causal(kwargs.get("mask_function"), *pattern):
            raise _refuse(
                "this forward needs an explicit mask (packed sequences in position_ids, a "
                "bidirectional or custom mask pattern); only plain causal attention is supported"
            )
    if attention_mask is not None:  # transformers' 2-D padding mask, as booleans
        if _capturing():
            raise _refuse(
                "under CUDA-graph capture pass attention_mask=None: whether it pads cannot be "
                "checked there"
            )
        if not bool(attention_mask.all()):  # under torch.compile: a graph break
            raise _refuse(
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
            causal attention is exact and raises elsewhere).
        dropout: must be 0 (the kernel has no dropout).
        scaling: the score scale (default ``1 / sqrt(d)``).
        sliding_window: at least ``N_k`` if given (else the window would mask keys).
        softcap: must be None.

    Under ``torch.autocast`` the three are cast to the autocast dtype first, as SDPA does.

    Returns:
        ``(output, None)``: output ``(B, N_q, H, d)`` contiguous; no attention weights.
    """
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
