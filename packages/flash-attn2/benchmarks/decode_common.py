"""What the decode benchmarks (``decode.py``, ``decode_int8_kv.py``) share: the float64 spec of
decode attention over a full cache, the relative error, and the stamp every row carries.

Loaded beside them with ``llmsys.bench_harness.load_beside(__file__, "decode_common")``.
"""

from __future__ import annotations

import math

import torch

from llmsys.bench_harness import results
from llmsys.flash_attn2 import __version__


def spec(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """float64 attention of each sequence's ``Q_LEN`` new queries over its whole cache, causal
    within the new tokens (query ``i`` sits at position ``N - Q_LEN + i`` and sees keys 0 to
    that position), the query heads grouped per kv head (no copy of the cache to every query
    head). One sequence at a time: at most one sequence's cache is in float64 at once.

    q ``(B, H, Q_LEN, D)``, caches ``(B, H_KV, N, D)`` full to ``N``; returns ``(B, H, Q_LEN, D)``
    float64.
    """
    _, heads, q_len, head_dim = q.shape
    kv_heads, context = k_cache.shape[1], k_cache.shape[2]
    positions = torch.arange(context - q_len, context, device=q.device)[:, None]  # (Q_LEN, 1)
    visible = torch.arange(context, device=q.device) <= positions  # (Q_LEN, N)
    outs = []
    for q_b, k_b, v_b in zip(q, k_cache, v_cache, strict=True):
        q4 = q_b.double().unflatten(0, (kv_heads, heads // kv_heads))  # (H_KV, G, Q_LEN, D)
        k, v = k_b.double().unsqueeze(1), v_b.double().unsqueeze(1)  # (H_KV, 1, N, D)
        scores = q4 @ k.transpose(-2, -1) / math.sqrt(head_dim)  # (H_KV, G, Q_LEN, N)
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ v).flatten(0, 1))  # (H, Q_LEN, D)
    return torch.stack(outs)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def stamp(device: str | torch.device) -> dict[str, str]:
    """The ``gpu``, ``version`` and ``timestamp`` fields of a row measured now on ``device``."""
    return {
        "gpu": results.device_name(device),
        "version": f"llmsys-flash-attn2 {__version__}, torch {torch.__version__}",
        "timestamp": results.timestamp(),
    }
