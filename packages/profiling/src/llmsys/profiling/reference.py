"""The executable spec: the Transformer LM as one plain function over a state dict.

Written independently of ``model.py`` (RoPE as a complex rotation, attention head by head with
an explicit lower-triangular mask, the MoE one token at a time), so that tests comparing the two
in float64 check the model's arithmetic, not a copy of it.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x (T, d): the pair (x[i], x[i + d/2]) as the complex number x[i] + 1j x[i + d/2], turned
    by the angle position * theta^(-2i/d)."""
    seq, dim = x.shape
    half = dim // 2
    angle = torch.arange(seq, dtype=x.dtype)[:, None] * theta ** (
        -torch.arange(0, dim, 2, dtype=x.dtype) / dim
    )
    turned = torch.complex(x[:, :half], x[:, half:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([turned.real, turned.imag], dim=-1)


def _attention(x: torch.Tensor, w: dict, prefix: str, config: ModelConfig) -> torch.Tensor:
    """x (T, d_model) of one sequence -> (T, d_model)."""
    seq, heads, dh = x.shape[0], config.num_heads, config.head_dim
    q, k, v = (x @ w[f"{prefix}.qkv_proj.weight"].T).split(config.d_model, dim=-1)
    allowed = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    outputs = []
    for h in range(heads):
        cols = slice(h * dh, (h + 1) * dh)
        qh, kh = _rope(q[:, cols], config.rope_theta), _rope(k[:, cols], config.rope_theta)
        scores = (qh @ kh.T / math.sqrt(dh)).masked_fill(~allowed, -math.inf)
        outputs.append(torch.softmax(scores, dim=-1) @ v[:, cols])
    return torch.cat(outputs, dim=-1) @ w[f"{prefix}.output_proj.weight"].T


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate = x @ w1.T
    return (gate * torch.sigmoid(gate) * (x @ w3.T)) @ w2.T


def _moe(x: torch.Tensor, w: dict, prefix: str, config: ModelConfig) -> torch.Tensor:
    """Each token: softmax over its topk router logits, the weighted sum of those experts."""
    p = f"{prefix}.experts"
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = x[t] @ w[f"{p}.router.weight"].T
        top, experts = logits.topk(config.topk)
        for weight, e in zip(torch.softmax(top, dim=-1), experts.tolist(), strict=True):
            expert = (w[f"{p}.w1"][e], w[f"{p}.w3"][e], w[f"{p}.w2"][e])
            out[t] += weight * _swiglu(x[t : t + 1], *expert)[0]
    return out


def transformer_lm_reference(
    state_dict: dict[str, torch.Tensor], tokens: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """Logits (B, T, vocab) of ``TransformerLM(config)`` holding ``state_dict``, for ``tokens``
    (B, T), computed in the state dict's dtype (use float64 for a reference)."""
    w = state_dict
    logits = []
    for sequence in tokens:
        x = w["embedding.weight"][sequence]  # (T, d_model)
        for i in range(config.num_layers):
            b = f"blocks.{i}"
            x = x + _attention(
                _rms_norm(x, w[f"{b}.attn_norm.weight"], config.norm_eps), w, f"{b}.attn", config
            )
            h = _rms_norm(x, w[f"{b}.ffn_norm.weight"], config.norm_eps)
            if config.ffn == "moe":
                x = x + _moe(h, w, f"{b}.ffn", config)
            else:
                weights = (
                    w[f"{b}.ffn.w1.weight"],
                    w[f"{b}.ffn.w3.weight"],
                    w[f"{b}.ffn.w2.weight"],
                )
                x = x + _swiglu(h, *weights)
        x = _rms_norm(x, w["final_norm.weight"], config.norm_eps)
        logits.append(x @ w["lm_head.weight"].T)
    return torch.stack(logits)
