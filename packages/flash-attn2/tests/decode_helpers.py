"""Shared helpers for the decode tests (test_decode.py, test_kv_cache_int8.py): caches with
garbage past each length, the float64 spec per sequence, and the decode module's switches."""

from __future__ import annotations

import torch

from llmsys.flash_attn2 import attention_reference, decode
from llmsys.triton_launch import forget

SMALL_CHUNK = 16  # keys per program in the CPU tests: 4 splits at capacity 64


def set_decode_switch(monkeypatch, name: str, value) -> None:
    """``decode.<name> = value`` until ``monkeypatch`` undoes it, recorded replays forgotten."""
    monkeypatch.setattr(decode, name, value)
    forget(decode.flash_attn2_decode)


def make_cache(batch, kv_heads, capacity, head_dim, lengths, dtype, device, layout="sliced"):
    """(k_cache, v_cache) views of shape (B, H_KV, capacity, D), NaN past each length.

    ``layout``: "contiguous"; "sliced", the first ``capacity`` rows of a longer buffer; or
    "token-major", a (B, capacity, H_KV, D) buffer transposed (rows strided by H_KV * D)."""
    caches = []
    for _ in "kv":
        if layout == "token-major":
            buf = torch.randn(batch, capacity, kv_heads, head_dim, device=device).to(dtype)
            cache = buf.transpose(1, 2)
        elif layout == "sliced":
            buf = torch.randn(batch, kv_heads, capacity + 24, head_dim, device=device).to(dtype)
            cache = buf[:, :, :capacity]
        else:
            cache = torch.randn(batch, kv_heads, capacity, head_dim, device=device).to(dtype)
        for b, length in enumerate(lengths):
            cache[b, :, length:] = float("nan")  # garbage past the length must not leak
        caches.append(cache)
    return caches


def decode_reference(q, k_cache, v_cache, lengths, scale=None):
    """float64 ``attention_reference`` per sequence: the new queries go last in a causal
    (top-left aligned) problem over the sequence's valid keys, behind zero queries."""
    outs = []
    q_len = q.shape[2]
    for b, length in enumerate(lengths):
        padded = torch.zeros(1, q.shape[1], length, q.shape[3], dtype=q.dtype, device=q.device)
        padded[:, :, length - q_len :] = q[b : b + 1]
        k, v = k_cache[b : b + 1, :, :length], v_cache[b : b + 1, :, :length]
        out, _ = attention_reference(padded, k, v, is_causal=True, scale=scale)
        outs.append(out[:, :, length - q_len :])
    return torch.cat(outs)
