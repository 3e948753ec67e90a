"""``nn.Module`` wrappers."""

from __future__ import annotations

import torch
from torch import nn

from llmsys.triton_launch import checks

from .functional import flash_attention


class FlashSelfAttention(nn.Module):
    """Multi-head self-attention with grouped-query heads over :func:`flash_attention`.

    Args:
        d_model: input and output width; a multiple of ``n_heads``.
        n_heads: query heads; head_dim = d_model // n_heads (at most 256).
        n_kv_heads: key/value heads, dividing ``n_heads`` (default ``n_heads``: plain multi-head).
        causal: default True, top-left aligned (see ``flash_attention``).
        device, dtype: for the projection weights.

    Shapes: ``x`` (B, N, d_model) -> (B, N, d_model). No biases.

    Raises:
        ValueError: a size is not a positive int, ``n_heads`` does not divide ``d_model`` or
            ``n_kv_heads`` does not divide ``n_heads``.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        causal: bool = True,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, value in (("d_model", d_model), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            checks.positive_int("FlashSelfAttention", name, value)
        if d_model % n_heads:
            raise ValueError(
                f"FlashSelfAttention: `n_heads` ({n_heads}) must divide `d_model` ({d_model})"
            )
        if n_heads % n_kv_heads:
            raise ValueError(
                f"FlashSelfAttention: `n_kv_heads` ({n_kv_heads}) must divide `n_heads` ({n_heads})"
            )
        self.n_heads, self.n_kv_heads, self.causal = n_heads, n_kv_heads, causal
        self.head_dim = d_model // n_heads
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(d_model, d_model, bias=False, **factory)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * self.head_dim, bias=False, **factory)
        self.out_proj = nn.Linear(d_model, d_model, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.n_heads, self.head_dim)  # (B, N, H, dh)
        kv = self.kv_proj(x).view(batch, seq, 2, self.n_kv_heads, self.head_dim)
        # Strided (B, H, N, dh) views: the kernels read them in place, no copies.
        q, k, v = q.transpose(1, 2), kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        out = flash_attention(q, k, v, causal=self.causal)  # (B, H, N, dh)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, -1))  # (B, N, d_model)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, causal={self.causal}"
