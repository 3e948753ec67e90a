"""Greedy generation over a static KV cache, each decode step replayed from one CUDA graph.

    tokens = generate(model, input_ids, max_new_tokens=64)

One prefill of the prompt fills a ``transformers.StaticCache``. Each new token is then one
decode step, the same call every time: it reads the token before from a fixed buffer, writes
its own there and advances the positions in place. That is what lets one CUDA graph of the step
replay it, with no Python between tokens. The model may be as transformers builds it, or
rewritten by ``apply_llmsys`` or by ``quantize_model``: one harness serves fp16
and int8, and the rewritten attention reads the static cache through flash-attn2
(``attention.static_cache_attention``). With ``kv_cache="int8"`` the cache is an
``Int8StaticCache`` (``llmsys.hf.kv_cache``), half a float16 one's bytes, which only that
rewritten attention reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from numbers import Integral
from typing import Any

import torch
from torch import nn

from .rewrite import original_class


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    cuda_graph: bool | None = None,
    kv_cache: str = "float",
) -> torch.Tensor:
    """``input_ids`` followed by ``max_new_tokens`` greedily chosen tokens, shape
    (batch, prompt + max_new_tokens).

    Args:
        model: a transformers causal LM (``model(ids, ...).logits``) on ``input_ids``' device.
            After ``apply_llmsys`` or ``quantize_model`` its attention reads the static cache
            through flash-attn2 (each decode step's ``decode_attention`` in place, grouped-query
            heads natively), whatever transformers version is installed; a stock model's runs
            as its attention implementation does (SDPA: with a mask over the cache's slots).
        input_ids: (batch, prompt) integer token ids, every row the same length (no padding).
        max_new_tokens: how many tokens to add, at least 1. Every row gets that many: there is
            no stop at an end-of-sequence token (cut the rows afterwards).
        cuda_graph: replay the decode step from a CUDA graph (default: on a CUDA device, unless
            the cache has sliding-window layers, which a graph cannot replay). The first step
            runs eagerly, which also warms up what the capture needs.
        kv_cache: ``"float"`` (default), a ``transformers.StaticCache`` in the model's dtype,
            or ``"int8"``, an ``Int8StaticCache`` (``llmsys.hf.kv_cache``): keys and values
            stored as int8 with one float32 scale per sequence, kv head and token, quantized as
            they are appended and dequantized by the decode kernel as it reads them. Only
            llmsys' attention reads it (after ``apply_llmsys`` with its rotary part, or
            ``quantize_model``); the tokens may differ from the float cache's where the
            quantization error tips a near-tie.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` with a ``config``, ``input_ids`` is not an
            int64 or int32 tensor, ``max_new_tokens`` is not an int, ``cuda_graph`` is not a
            bool or None, or ``kv_cache`` is not a str.
        ValueError: ``input_ids`` is not (batch, prompt) with both sizes > 0,
            ``max_new_tokens`` < 1, or ``cuda_graph=True`` with ``input_ids`` off CUDA or
            with a model whose cache has sliding-window layers (a window shorter than the
            prompt and the new tokens), ``kv_cache`` is neither "float" nor "int8", or
            ``kv_cache="int8"`` with a model whose attention is not llmsys' (transformers'
            attention forward, or an attention implementation other than ``llmsys_fa2`` or
            ``llmsys_serve``) or whose cache would have sliding-window layers.
    """
    _check_arguments(model, input_ids, max_new_tokens, cuda_graph, kv_cache)
    on_cuda = input_ids.device.type == "cuda"
    if cuda_graph and not on_cuda:
        raise ValueError(
            "generate: `cuda_graph=True` needs `input_ids` on a CUDA device, got "
            f"{input_ids.device}"
        )

    from transformers import StaticCache

    cache_class = StaticCache
    if kv_cache == "int8":
        from .kv_cache import Int8StaticCache, check_int8_readers

        check_int8_readers(model, "generate")
        cache_class = Int8StaticCache
    batch, prompt = input_ids.shape
    ids = input_ids.long()
    cache = cache_class(config=model.config, max_cache_len=prompt + int(max_new_tokens))
    sliding = sliding_layers(cache)
    if cuda_graph is None:
        cuda_graph = on_cuda and not sliding
    if cuda_graph and sliding:
        raise ValueError(
            f"generate: `cuda_graph=True` cannot replay this model's cache: its layers {sliding} "
            "are sliding-window layers, which keep their length on the host and change what "
            "they run once the window is full; pass cuda_graph=False (or leave it None)"
        )
    call = cached_forward(model, cache)
    with torch.no_grad():
        positions = torch.arange(prompt, device=ids.device).expand(batch, prompt)
        logits = call(ids, positions, logits_to_keep=1)
        token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (batch, 1): the step's buffers
        position = torch.full((batch, 1), prompt, dtype=torch.long, device=ids.device)

        def step() -> None:
            token.copy_(call(token, position)[:, -1].argmax(dim=-1, keepdim=True))
            position.add_(1)

        new = [token.clone()]
        if max_new_tokens > 1:
            step()
            new.append(token.clone())
        run = step
        if cuda_graph and max_new_tokens > 2:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # recorded, not run: the state does not advance
                step()
            run = graph.replay
        for _ in range(max_new_tokens - 2):
            run()
            new.append(token.clone())
    return torch.cat([ids, *new], dim=1).to(input_ids.dtype)


def sliding_layers(cache: Any) -> list[int]:
    """The indices of ``cache``'s sliding-window layers (transformers' ``is_sliding``)."""
    return [i for i, layer in enumerate(getattr(cache, "layers", ())) if layer.is_sliding]


KV_CACHES = ("float", "int8")


def _check_arguments(
    model: object, input_ids: object, max_new_tokens: object, cuda_graph: object, kv_cache: object
) -> None:
    """``generate``'s arguments, each refused by name before anything runs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"generate: `model` must be an nn.Module, got {type(model).__name__}")
    if getattr(model, "config", None) is None:
        raise TypeError(
            "generate: `model` must be a causal LM with a `config` (a transformers model), got "
            f"{type(model).__name__}"
        )
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"generate: `input_ids` must be a torch.Tensor, got {type(input_ids).__name__}"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            "generate: `input_ids` must be (batch, prompt) with both sizes > 0, got "
            f"{tuple(input_ids.shape)}"
        )
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"generate: `input_ids` must hold int64 or int32 token ids, got {input_ids.dtype}"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral):
        raise TypeError(
            f"generate: `max_new_tokens` must be an int, got {type(max_new_tokens).__name__}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"generate: `max_new_tokens` must be >= 1, got {max_new_tokens}")
    if cuda_graph is not None and not isinstance(cuda_graph, bool):
        raise TypeError(
            f"generate: `cuda_graph` must be a bool or None, got {type(cuda_graph).__name__}"
        )
    if not isinstance(kv_cache, str):
        raise TypeError(
            f"generate: `kv_cache` must be a str ('float' or 'int8'), got {type(kv_cache).__name__}"
        )
    if kv_cache not in KV_CACHES:
        raise ValueError(f"generate: `kv_cache` must be 'float' or 'int8', got {kv_cache!r}")


def cached_forward(model: nn.Module, cache: Any) -> Callable[..., torch.Tensor]:
    """``call(ids, positions, **extra) -> logits``: ``model``'s forward on token ``ids`` at
    ``positions`` (both (batch, tokens)), reading and writing ``cache`` at those positions. It
    passes the keywords this transformers version takes: ``cache`` or ``past_key_values``, and
    ``cache_position`` where the model still has it (positions from the cache's length would
    cost a host sync, and a CUDA graph could not replay them). The keywords are read from the
    transformers class's forward (``rewrite.original_class``): ``apply_llmsys``' loss forward
    takes ``**kwargs`` and hands them to it."""
    parameters = inspect.signature(original_class(model).forward).parameters
    key = "cache" if "cache" in parameters else "past_key_values"
    with_cache_position = "cache_position" in parameters

    def call(ids: torch.Tensor, positions: torch.Tensor, **extra: Any) -> torch.Tensor:
        if with_cache_position:
            extra["cache_position"] = positions[0]
        out = model(ids, position_ids=positions, use_cache=True, **{key: cache}, **extra)
        return out.logits

    return call
