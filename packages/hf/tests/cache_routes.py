"""What the static-cache tests share: the attention routes a forward takes (``routes``), the
logits of tokens fed through a static cache as ``generate`` feeds them, and a served model with
its SDPA reference."""

import contextlib
import copy
from unittest import mock

import pytest
import torch
from hf_models import build

from llmsys.hf import apply_llmsys, cached_forward, quantize_model
from llmsys.hf import attention as hf_attention

transformers = pytest.importorskip("transformers")


@contextlib.contextmanager
def routes():
    """What the attention runs: the arguments of every ``decode_attention`` and
    ``flash_attention`` call of llmsys.hf's attention (``scales``: each decode call's
    ``k_scale`` and ``v_scale`` addresses, None for a float cache), and the number of SDPA
    calls."""
    seen = {"decode": [], "scales": [], "flash": [], "sdpa": 0}
    decode, flash = hf_attention.decode_attention, hf_attention.flash_attention
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy_decode(q, k_cache, v_cache, cache_seqlens, **kwargs):
        lengths = cache_seqlens.tolist() if cache_seqlens.device.type == "cpu" else None
        seen["decode"].append((q.shape[2], k_cache.data_ptr(), v_cache.data_ptr(), lengths))
        scales = kwargs.get("k_scale"), kwargs.get("v_scale")
        seen["scales"].append(None if scales[0] is None else tuple(s.data_ptr() for s in scales))
        return decode(q, k_cache, v_cache, cache_seqlens, **kwargs)

    def spy_flash(q, k, v, causal=False, scale=None):
        seen["flash"].append((q.shape[2], k.shape[2], causal))
        return flash(q, k, v, causal, scale)

    def spy_sdpa(*args, **kwargs):
        seen["sdpa"] += 1
        return sdpa(*args, **kwargs)

    with (
        mock.patch.object(hf_attention, "decode_attention", spy_decode),
        mock.patch.object(hf_attention, "flash_attention", spy_flash),
        mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa),
    ):
        yield seen


def logits_over_a_static_cache(model, tokens, segments, cache_class=None):
    """The logits of ``tokens`` (B, T) fed through one static cache (``cache_class``, default
    ``transformers.StaticCache``) a segment at a time (``segments``: (start, end) pairs), as
    ``generate``'s prefill and decode steps feed them: (B, T, vocab) float32, and the cache."""
    cache_class = cache_class or transformers.StaticCache
    cache = cache_class(config=model.config, max_cache_len=tokens.shape[1])
    call = cached_forward(model, cache)
    out = []
    with torch.no_grad():
        for start, end in segments:
            positions = torch.arange(start, end, device=tokens.device).expand(len(tokens), -1)
            out.append(call(tokens[:, start:end], positions).float())
    return torch.cat(out, dim=1), cache


def served_and_sdpa(rewrite: str, device, family="llama", dtype=torch.float32, **config):
    """(the rewritten model, the same model on the SDPA path): for ``apply_llmsys`` the stock
    model as transformers builds it, for ``quantize_model`` the same int8 model set to SDPA."""
    stock = build(family, **config).to(device, dtype).eval()
    served = copy.deepcopy(stock)
    if rewrite == "apply_llmsys":
        apply_llmsys(served)
        return served, stock
    quantize_model(served)
    reference = copy.deepcopy(served)
    reference.set_attn_implementation("sdpa")
    return served, reference
