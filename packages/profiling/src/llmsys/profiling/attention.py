"""Causal attention three ways, all on ``(B, H, T, d)`` tensors: what the model switches between.

- ``naive_attention``: the textbook formula in eager PyTorch; it materializes the (T, T) scores,
  and marks its three steps with profiler ranges (``attention/scores``, ``attention/softmax``,
  ``attention/weighted_sum``; NVTX ranges under ``torch.autograd.profiler.emit_nvtx``).
- ``sdpa_attention``: ``torch.nn.functional.scaled_dot_product_attention`` (flash, cuDNN or
  memory-efficient backends, whichever PyTorch picks).
- ``flash_attention``: ``llmsys.flash_attn2``'s Triton FlashAttention-2.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.profiler import record_function


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + causal mask) v`` with the (B, H, T, T) scores in memory."""
    seq = q.shape[-2]
    with record_function("attention/scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    with record_function("attention/softmax"):
        probs = torch.softmax(scores, dim=-1)
    with record_function("attention/weighted_sum"):
        return probs.to(v.dtype) @ v  # (B, H, T, d)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from llmsys.flash_attn2 import flash_attention as flash_attn2  # imports Triton: only if used

    return flash_attn2(q, k, v, causal=True)


ATTENTION_FUNCTIONS = {
    "naive": naive_attention,
    "sdpa": sdpa_attention,
    "flash": flash_attention,
}
