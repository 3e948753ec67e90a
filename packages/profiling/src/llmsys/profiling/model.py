"""``TransformerLM``: a pre-norm decoder-only language model with switchable llmsys parts.

    tokens (B, T) -> embedding -> num_layers x [x + attn(norm(x)); x + ffn(norm(x))]
                  -> final RMSNorm -> lm_head -> logits (B, T, vocab)
                                                 (or, with targets, the mean cross-entropy)

Attention is causal multi-head attention with rotary position embeddings (RoPE) on q and k; the
feed-forward is SwiGLU, ``w2(silu(w1 x) * w3 x)``, or a mixture of SwiGLU experts. Which
implementation runs each part is set by :class:`~llmsys.profiling.config.ModelConfig`. With
``norm="fused"`` each residual add moves into the RMSNorm kernel that follows it
(:class:`FusedResidualBlock`); with ``loss="fused"`` the loss comes from the final hidden states
without the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import ATTENTION_FUNCTIONS
from .config import ModelConfig
from .training import lm_loss

INIT_STD = 0.02
IGNORE_INDEX = -100  # the target F.cross_entropy (lm_loss) and the fused loss skip


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check_dtype(owner: str, dtype: object) -> None:
    """The parameters' dtype: None (torch's default) or a floating dtype, else ``TypeError``
    (torch's own error, about gradients, names no argument)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{owner}: `dtype` must be None or a floating dtype, got {dtype}")


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 and returned in ``x``'s dtype.

    ``fused=True`` runs ``llmsys.kernels_fused.rms_norm``: one pass, and the residual add in
    front of the norm in the same kernel. It rounds ``x / rms(x)`` to ``x``'s dtype before
    multiplying by ``weight`` (Hugging Face's order), where this module multiplies in float32
    and rounds once: identical formulas for a float32 ``x`` (the model's residual stream, also
    under autocast), up to one rounding of the output apart for a 16-bit ``x``.
    """

    def __init__(
        self,
        d_model: int,
        eps: float = 1e-5,
        *,
        fused: bool = False,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_dtype("RMSNorm", dtype)
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.kernel: Callable[..., Any] | None = None
        if fused:
            from llmsys.kernels_fused import rms_norm  # imports Triton: only if used

            self.kernel = rms_norm

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``, ``(norm(s), s)`` for ``s = x + residual`` in ``x``'s
        dtype (the fused kernel adds, keeps ``s`` for the next residual add, and normalises)."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            s = (x + residual).to(x.dtype)
            return self._normalize(s), s
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(_at_least_float32(x.dtype))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates each (i, i + d/2) pair of q and k by ``position * theta^(-2i/d)``.

    The cos/sin tables are buffers (not saved in the state dict, rebuilt from the config), in
    float32, or float64 for a float64 model; the rotation runs in at least float32.

    ``fused=True``: :meth:`rotate` runs ``llmsys.kernels_fused.rotary`` on q and k in one launch.
    Rotating the (i, i + d/2) pairs is Hugging Face's ``rotate_half`` convention, whose tables
    hold each angle twice: full-width (1, context, d) copies are built once for it.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    cos_full: torch.Tensor
    sin_full: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        context_length: int,
        theta: float,
        *,
        fused: bool = False,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
        positions = torch.arange(context_length, device=device, dtype=torch.float64)
        angles = torch.outer(positions, theta**-exponents)  # (context, d/2)
        table_dtype = _at_least_float32(dtype or torch.get_default_dtype())
        self.register_buffer("cos", angles.cos().to(table_dtype), persistent=False)
        self.register_buffer("sin", angles.sin().to(table_dtype), persistent=False)
        self.kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        if fused:
            from llmsys.kernels_fused import rotary  # imports Triton: only if used

            self.kernel = rotary
            for name in ("cos", "sin"):
                half = getattr(self, name)  # (context, d/2)
                full = torch.cat([half, half], dim=-1).unsqueeze(0)  # (1, context, d)
                self.register_buffer(f"{name}_full", full, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq, half = x.shape[-2], x.shape[-1] // 2
        cos, sin = self.cos[:seq], self.sin[:seq]  # (T, d/2)
        wide = _at_least_float32(x.dtype)
        x1, x2 = x[..., :half].to(wide), x[..., half:].to(wide)  # (B, H, T, d/2) each
        rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return rotated.to(x.dtype)  # (B, H, T, d)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rope(q), rope(k))``; fused: both in one kernel, in q's dtype."""
        if self.kernel is None:
            return self(q), self(k)
        seq = q.shape[-2]
        return self.kernel(q, k, self.cos_full[:, :seq], self.sin_full[:, :seq])


class CausalSelfAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv_proj = nn.Linear(config.d_model, 3 * config.d_model, bias=False, **factory)
        self.output_proj = nn.Linear(config.d_model, config.d_model, bias=False, **factory)
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.context_length,
            config.rope_theta,
            fused=config.rope == "fused",
            **factory,
        )
        self.attend = ATTENTION_FUNCTIONS[config.attention]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, dh)
        q, k = self.rope.rotate(q, k)
        out = self.attend(q, k, v)  # (B, H, T, dh)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` with the activation in eager PyTorch or the Triton kernel."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
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

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
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
    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        norm = {"fused": config.norm == "fused", **factory}
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps, **norm)
        self.attn = CausalSelfAttention(config, **factory)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps, **norm)
        self.ffn = (MoE if config.ffn == "moe" else SwiGLU)(config, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class FusedResidualBlock(TransformerBlock):
    """The block for ``norm="fused"``: each residual add runs in the RMSNorm kernel after it.

        (x, branch) -> h, x = attn_norm(x + branch)    one kernel: the previous block's FFN add
                    -> h, x = ffn_norm(x + attn(h))    one kernel: this block's attention add
                    -> (x, ffn(h))                     the FFN add: the next norm's

    The residual stream is ``x + branch``: what :class:`TransformerBlock` returns for the same
    input. The first block gets ``branch=None``; the final norm adds the last block's branch.
    """

    # (not TransformerBlock's call: the residual branch travels with the stream, by design)
    def forward(  # type: ignore[override]
        self, x: torch.Tensor, branch: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if branch is None:
            h = self.attn_norm(x)
        else:
            h, x = self.attn_norm(x, branch)  # x stays the float32 stream (x's dtype)
        h, x = self.ffn_norm(x, self.attn(h))
        return x, self.ffn(h)


class TransformerLM(nn.Module):
    """Decoder-only LM: ``TransformerLM(ModelConfig.named("medium", attention="flash"))``.

    Args:
        config: a :class:`ModelConfig` (default: the "small" size with SDPA attention).
        device, dtype: for the parameters (default: PyTorch's defaults).

        check_tokens: check in ``forward`` that every token id, and every target that is not
            -100, is in ``[0, vocab_size)`` (ValueError naming ``tokens`` or ``targets``
            otherwise: on CPU an IndexError, on CUDA a device-side assert that poisons the
            process, for the eager loss; a NaN loss on CUDA for the fused one). It reads the
            bounds back from the device in one synchronization, so it is skipped inside
            CUDA-graph capture and torch.compile; turn it off where that synchronization would
            cost (timed loops). Default True.

    Shapes: ``model(tokens)``: ``tokens`` (B, T) int64 with T <= ``config.context_length`` ->
    logits (B, T, vocab_size) in the dtype of the last matmul (float32, or bf16 under autocast).
    ``model(tokens, targets)``: ``targets`` (B, T) int64 (-100: ignored) -> the mean
    next-token cross-entropy, a 0-d float32 tensor (``training.lm_loss`` of the logits); with
    ``config.loss == "fused"`` computed by ``llmsys.kernels_fused.linear_cross_entropy`` from
    the final hidden states, without building the logits.
    Weights start from a normal of std 0.02 (MoE experts keep their own init); norms at 1.

    Raises:
        TypeError: ``config`` is not a ``ModelConfig``, ``check_tokens`` not a bool, or
            ``dtype`` not None or a floating dtype.
    """

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
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
        _check_dtype("TransformerLM", dtype)
        self.config = config
        self.check_tokens = check_tokens
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embedding = nn.Embedding(config.vocab_size, config.d_model, **factory)
        block: type[TransformerBlock] = (
            FusedResidualBlock if config.norm == "fused" else TransformerBlock
        )
        self.blocks = nn.ModuleList(block(config, **factory) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(
            config.d_model, config.norm_eps, fused=config.norm == "fused", **factory
        )
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False, **factory)
        self.loss_kernel: Callable[..., torch.Tensor] | None = None
        if config.loss == "fused":
            from llmsys.kernels_fused import linear_cross_entropy  # imports Triton: only if used

            self.loss_kernel = linear_cross_entropy
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.trunc_normal_(module.weight, std=INIT_STD, a=-3 * INIT_STD, b=3 * INIT_STD)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits, or with ``targets`` the loss (see the class).

        Raises:
            TypeError: ``tokens`` is not an int32 or int64 tensor, ``targets`` not an int64 one.
            ValueError: ``tokens`` is not (batch, seq) with seq <= ``context_length``,
                ``targets`` not of its shape, or (``check_tokens``) an id is out of range.
        """
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
        if targets is not None:
            _check_targets(targets, tokens)
        if self.check_tokens and _can_synchronize(tokens):
            _check_ids(tokens, targets, self.config.vocab_size)
        x = self.embedding(tokens)  # (B, T, d_model)
        recompute = self.config.checkpoint and torch.is_grad_enabled()
        if self.config.norm == "fused":
            hidden = self._fused_residual_blocks(x, recompute)
        else:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
            hidden = self.final_norm(x)  # (B, T, d_model)
        if targets is None:
            return self.lm_head(hidden)  # (B, T, vocab)
        if self.loss_kernel is not None:  # no logits: lm_head's weight read outside lm_head,
            # so its input in the weight's dtype, as lm_head would take it (FSDP's compute_dtype
            # casts the weight and an fp32 norm gain leaves the hidden states in float32)
            weight = self.lm_head.weight
            return self.loss_kernel(hidden.to(weight.dtype), weight, targets)
        return lm_loss(self.lm_head(hidden), targets)

    def _fused_residual_blocks(self, x: torch.Tensor, recompute: bool) -> torch.Tensor:
        """The blocks and the final norm with ``norm="fused"``: the stream travels as
        ``(x, branch)`` and each norm kernel adds the pending branch."""
        branch = None
        for block in self.blocks:
            if recompute:
                x, branch = checkpoint(block, x, branch, use_reentrant=False)
            else:
                x, branch = block(x, branch)
        if branch is None:  # no blocks
            return self.final_norm(x)
        return self.final_norm(x, branch)[0]  # (B, T, d_model)


def _can_synchronize(t: torch.Tensor) -> bool:
    # Reading a value back is impossible while torch.compile traces (it does not exist yet) and
    # would break a CUDA graph being captured.
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_targets(targets: object, tokens: torch.Tensor) -> None:
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
        raise TypeError(
            "TransformerLM: `targets` must be an int64 tensor, got "
            f"{getattr(targets, 'dtype', type(targets).__name__)}"
        )
    if targets.shape != tokens.shape:
        raise ValueError(
            f"TransformerLM: `targets` must have the shape of `tokens` {tuple(tokens.shape)}, "
            f"got {tuple(targets.shape)}"
        )


def _check_ids(tokens: torch.Tensor, targets: torch.Tensor | None, vocab_size: int) -> None:
    """ValueError naming ``tokens`` (or ``targets``) unless every id is in [0, vocab_size)
    (for targets, or IGNORE_INDEX): an out-of-range id is an IndexError on CPU and a
    device-side assert that poisons the process on CUDA. One read-back for both."""
    if tokens.numel() == 0:  # (targets has tokens' shape)
        return
    checked = [tokens.long()]
    if targets is not None:
        checked.append(targets.masked_fill(targets == IGNORE_INDEX, 0))  # ignored: a valid id
    bounds = torch.cat([torch.stack(torch.aminmax(t)) for t in checked]).tolist()
    low, high = bounds[:2]
    if low < 0 or high >= vocab_size:
        bad = ((tokens < 0) | (tokens >= vocab_size)).nonzero()[0].tolist()
        raise ValueError(
            f"TransformerLM: `tokens` must hold ids in [0, vocab_size={vocab_size}), got ids "
            f"from {low} to {high}; the first out of range is {int(tokens[tuple(bad)])} at "
            f"position {tuple(bad)}"
        )
    if targets is not None and (bounds[2] < 0 or bounds[3] >= vocab_size):
        out = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))
        bad = out.nonzero()[0].tolist()
        raise ValueError(
            f"TransformerLM: `targets` must hold ids in [0, vocab_size={vocab_size}) or "
            f"{IGNORE_INDEX} (ignored), got {int(targets[tuple(bad)])} at position {tuple(bad)}"
        )


def num_parameters(model: nn.Module, *, embedding: bool = True) -> int:
    """Parameter count; ``embedding=False`` leaves out the token embedding table."""
    has_table = not embedding and hasattr(model, "embedding")
    skip = {id(model.get_submodule("embedding").weight)} if has_table else set()
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def use_int8_linears(model: TransformerLM) -> TransformerLM:
    """Swap every linear layer for ``llmsys.kernels_int8.Int8Linear`` (inference only, in place).

    Call it on a model already in its inference dtype (float16 or bfloat16); the router of an MoE
    variant stays in floating point (its logits pick the experts).

    Raises:
        TypeError: ``model`` is not a ``TransformerLM``.
        ValueError: ``model`` has the fused loss, which needs ``lm_head``'s floating-point
            weight.
    """
    from llmsys.kernels_int8 import quantize_linears

    if not isinstance(model, TransformerLM):
        raise TypeError(
            f"use_int8_linears: `model` must be a TransformerLM, got {type(model).__name__}"
        )
    if model.config.loss == "fused":
        raise ValueError(
            "use_int8_linears: `model` must have config.loss='eager' (the fused loss reads "
            "lm_head's floating-point weight), got loss='fused'"
        )

    return quantize_linears(model, include=lambda name, linear: not name.endswith("router"))
