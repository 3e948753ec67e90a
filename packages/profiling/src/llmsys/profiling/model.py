"""``TransformerLM``: a pre-norm decoder-only language model with switchable llmsys parts.

    tokens (B, T) -> embedding -> num_layers x [x + attn(norm(x)); x + ffn(norm(x))]
                  -> final RMSNorm -> lm_head -> logits (B, T, vocab)

Attention is causal multi-head attention with rotary position embeddings (RoPE) on q and k; the
feed-forward is SwiGLU, ``w2(silu(w1 x) * w3 x)``, or a mixture of SwiGLU experts. Which
implementation runs each part is set by :class:`~llmsys.profiling.config.ModelConfig`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import ATTENTION_FUNCTIONS
from .config import ModelConfig

INIT_STD = 0.02


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and returned in ``x``'s dtype."""

    def __init__(self, d_model: int, eps: float = 1e-5, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(_at_least_float32(x.dtype))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates each (i, i + d/2) pair of q and k by ``position * theta^(-2i/d)``.

    The cos/sin tables are buffers (not saved in the state dict, rebuilt from the config), in
    float32, or float64 for a float64 model; the rotation runs in at least float32.
    """

    def __init__(
        self, head_dim: int, context_length: int, theta: float, *, device=None, dtype=None
    ) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
        positions = torch.arange(context_length, device=device, dtype=torch.float64)
        angles = torch.outer(positions, theta**-exponents)  # (context, d/2)
        table_dtype = _at_least_float32(dtype or torch.get_default_dtype())
        self.register_buffer("cos", angles.cos().to(table_dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(table_dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, half = x.shape[-2], x.shape[-1] // 2
        cos, sin = self.cos[:seq], self.sin[:seq]  # (T, d/2)
        wide = _at_least_float32(x.dtype)
        x1, x2 = x[..., :half].to(wide), x[..., half:].to(wide)  # (B, H, T, d/2) each
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return rotated.to(x.dtype)  # (B, H, T, d)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.d_model, 3 * config.d_model, bias=False, **factory)
        self.output_proj = nn.Linear(config.d_model, config.d_model, bias=False, **factory)
        self.rope = RotaryEmbedding(
            config.head_dim, config.context_length, config.rope_theta, **factory
        )
        self.attend = ATTENTION_FUNCTIONS[config.attention]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, dh)
        out = self.attend(self.rope(q), self.rope(k), v)  # (B, H, T, dh)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` with the activation in eager PyTorch or the Triton kernel."""

    def __init__(self, config: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.w1 = nn.Linear(config.d_model, config.d_ff, bias=False, **factory)  # gate
        self.w3 = nn.Linear(config.d_model, config.d_ff, bias=False, **factory)  # up
        self.w2 = nn.Linear(config.d_ff, config.d_model, bias=False, **factory)  # down
        self.fused = config.ffn == "swiglu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)  # (B, T, d_ff) each
        if self.fused:
            from llmsys.kernels_swiglu import swiglu

            return self.w2(swiglu(gate, up))
        return self.w2(F.silu(gate) * up)


class MoE(nn.Module):
    """``llmsys.kernels_moe.MoEFeedForward`` that runs its experts in the dtype autocast picks."""

    def __init__(self, config: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        from llmsys.kernels_moe import MoEFeedForward

        self.experts = MoEFeedForward(
            config.d_model,
            config.d_ff,
            config.num_experts,
            config.topk,
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            # The permute kernels need one dtype for tokens, expert outputs and routing weights.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return self.experts(x)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, **factory)
        self.attn = CausalSelfAttention(config, **factory)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, **factory)
        self.ffn = (MoE if config.ffn == "moe" else SwiGLU)(config, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    """Decoder-only LM: ``TransformerLM(ModelConfig.named("medium", attention="flash"))``.

    Args:
        config: a :class:`ModelConfig` (default: the "small" size with SDPA attention).
        device, dtype: for the parameters (default: PyTorch's defaults).

        check_tokens: check in ``forward`` that every token id is in ``[0, vocab_size)``
            (ValueError naming ``tokens`` otherwise). It reads two numbers back from the
            device, so it is skipped inside CUDA-graph capture and torch.compile; turn it off
            where that synchronization would cost (timed loops). Default True.

    Shapes: ``tokens`` (B, T) int64 with T <= ``config.context_length`` -> logits
    (B, T, vocab_size) in the dtype of the last matmul (float32, or bf16 under autocast).
    Weights start from a normal of std 0.02 (MoE experts keep their own init); norms at 1.
    """

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        device=None,
        dtype=None,
        check_tokens: bool = True,
    ) -> None:
        super().__init__()
        config = ModelConfig() if config is None else config
        if not isinstance(config, ModelConfig):
            raise TypeError(
                f"TransformerLM: `config` must be a ModelConfig, got {type(config).__name__}"
            )
        if not isinstance(check_tokens, bool):
            raise TypeError(
                f"TransformerLM: `check_tokens` must be a bool, got {type(check_tokens).__name__}"
            )
        self.config = config
        self.check_tokens = check_tokens
        factory = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(config.vocab_size, config.d_model, **factory)
        self.blocks = nn.ModuleList(
            TransformerBlock(config, **factory) for _ in range(config.num_layers)
        )
        self.final_norm = RMSNorm(config.d_model, config.norm_eps, **factory)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, **factory)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                "TransformerLM: `tokens` must be an int32/int64 tensor, got "
                f"{getattr(tokens, 'dtype', type(tokens).__name__)}"
            )
        if tokens.dim() != 2 or tokens.shape[1] > self.config.context_length:
            raise ValueError(
                "TransformerLM: `tokens` must have shape (batch, seq) with seq <= "
                f"context_length={self.config.context_length}, got {tuple(tokens.shape)}"
            )
        if self.check_tokens and _can_synchronize(tokens):
            _check_token_ids(tokens, self.config.vocab_size)
        x = self.embedding(tokens)  # (B, T, d_model)
        recompute = self.config.checkpoint and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.lm_head(self.final_norm(x))  # (B, T, vocab)


def _can_synchronize(t: torch.Tensor) -> bool:
    # Reading a value back is impossible while torch.compile traces (it does not exist yet) and
    # would break a CUDA graph being captured.
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """ValueError naming ``tokens`` unless every id is in [0, vocab_size): an out-of-range id
    is an IndexError on CPU and a device-side assert that poisons the process on CUDA."""
    if tokens.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(tokens))
    if low < 0 or high >= vocab_size:
        bad = ((tokens < 0) | (tokens >= vocab_size)).nonzero()[0].tolist()
        raise ValueError(
            f"TransformerLM: `tokens` must hold ids in [0, vocab_size={vocab_size}), got ids "
            f"from {low} to {high}; the first out of range is {int(tokens[tuple(bad)])} at "
            f"position {tuple(bad)}"
        )


def num_parameters(model: nn.Module, *, embedding: bool = True) -> int:
    """Parameter count; ``embedding=False`` leaves out the token embedding table."""
    skip = {id(model.embedding.weight)} if not embedding and hasattr(model, "embedding") else set()
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def use_int8_linears(model: TransformerLM) -> TransformerLM:
    """Swap every linear layer for ``llmsys.kernels_int8.Int8Linear`` (inference only, in place).

    Call it on a model already in its inference dtype (float16 or bfloat16); the router of an MoE
    variant stays in floating point (its logits pick the experts).
    """
    from llmsys.kernels_int8 import quantize_linears

    return quantize_linears(model, include=lambda name, linear: not name.endswith("router"))
