"""``ModelConfig``: the Transformer LM's sizes and which implementation each part uses."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# d_model, d_ff, num_layers, num_heads of the named sizes (the assignment's table, and "tiny"
# for smoke runs on a CPU).
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (64, 128, 2, 4),
    "small": (768, 3072, 12, 12),
    "medium": (1024, 4096, 24, 16),
    "large": (1280, 5120, 36, 20),
    "xl": (1600, 6400, 48, 25),
    "2.7B": (2560, 10240, 32, 32),
}

ATTENTION = ("naive", "sdpa", "flash")  # eager PyTorch, F.scaled_dot_product_attention, ours
FFN = ("eager", "swiglu", "moe")  # F.silu(a) * b, llmsys.kernels_swiglu, llmsys.kernels_moe
# eager PyTorch, or llmsys.kernels_fused (rms_norm / rotary / linear_cross_entropy)
NORM = ROPE = LOSS = ("eager", "fused")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that defines a :class:`~llmsys.profiling.TransformerLM`.

    Args:
        vocab_size: tokens in the vocabulary. Default 10000.
        context_length: the longest sequence (the RoPE tables' length). Default 1024.
        d_model, d_ff, num_layers, num_heads: widths and depth; ``num_heads`` divides
            ``d_model``. Defaults: the "small" size.
        rope_theta: RoPE base, a finite number > 0. Default 10000.
        norm_eps: RMSNorm epsilon, a finite number > 0. Default 1e-5.
        attention: "naive" (eager matmuls and softmax, with profiler ranges for scores /
            softmax / weighted sum), "sdpa" (``F.scaled_dot_product_attention``) or "flash"
            (``llmsys.flash_attn2.flash_attention``). Default "sdpa".
        ffn: "eager" (SwiGLU with ``F.silu(a) * b``), "swiglu" (``llmsys.kernels_swiglu``) or
            "moe" (``llmsys.kernels_moe.MoEFeedForward``: ``num_experts`` SwiGLU experts of
            width ``d_ff``, ``topk`` per token). Default "eager".
        num_experts, topk: the MoE variant's experts and experts per token. Defaults 8 and 2.
        checkpoint: recompute each block in the backward instead of keeping its activations
            (per-block activation checkpointing). Default False.
        norm: "eager" (RMSNorm in float32 PyTorch ops) or "fused"
            (``llmsys.kernels_fused.rms_norm``, with each residual add done by the norm that
            follows it). The kernel rounds the normalised value to the input's dtype before the
            weight multiplies it (Hugging Face's order); eager multiplies in float32 and rounds
            once. The same for the float32 residual stream (fp32 or bf16 autocast); for a
            16-bit model, one rounding of the output apart. Default "eager".
        rope: "eager" (each of q and k rotated by PyTorch ops) or "fused"
            (``llmsys.kernels_fused.rotary``: q and k in one launch). Default "eager".
        loss: "eager" (``lm_head``'s logits, then ``F.cross_entropy`` in float32) or "fused"
            (``llmsys.kernels_fused.linear_cross_entropy``: the loss from the final hidden
            states in chunks of tokens, the logits never built whole). Used by
            ``TransformerLM(tokens, targets)``. Default "eager".

    Raises:
        ValueError: naming the field: a size that is not a positive int, a ``rope_theta`` or
            ``norm_eps`` that is not finite and positive, an unknown ``attention``, ``ffn``,
            ``norm``, ``rope`` or ``loss``, or a ``topk`` above ``num_experts`` for the MoE variant.
    """

    vocab_size: int = 10000
    context_length: int = 1024
    d_model: int = 768
    d_ff: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    attention: str = "sdpa"
    ffn: str = "eager"
    num_experts: int = 8
    topk: int = 2
    checkpoint: bool = False
    norm: str = "eager"
    rope: str = "eager"
    loss: str = "eager"

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "context_length", "d_model", "d_ff", "num_layers", "num_heads")
        for name in (*sizes, "num_experts", "topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig: `{name}` must be a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or not 0 < value < math.inf:  # NaN fails too
                raise ValueError(
                    f"ModelConfig: `{name}` must be a finite number > 0, got {value!r}"
                )
        if not isinstance(self.checkpoint, bool):
            raise ValueError(f"ModelConfig: `checkpoint` must be a bool, got {self.checkpoint!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"ModelConfig: `num_heads` ({self.num_heads}) must divide `d_model` "
                f"({self.d_model})"
            )
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(
                "ModelConfig: the head dimension `d_model` // `num_heads` must be even for "
                f"RoPE, got {self.d_model} // {self.num_heads} = {self.d_model // self.num_heads}"
            )
        if self.attention not in ATTENTION:
            raise ValueError(
                f"ModelConfig: `attention` must be one of {ATTENTION}, got {self.attention!r}"
            )
        if self.ffn not in FFN:
            raise ValueError(f"ModelConfig: `ffn` must be one of {FFN}, got {self.ffn!r}")
        for name, choices in (("norm", NORM), ("rope", ROPE), ("loss", LOSS)):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"ModelConfig: `{name}` must be one of {choices}, got {getattr(self, name)!r}"
                )
        if self.ffn == "moe" and not 1 <= self.topk <= self.num_experts:
            raise ValueError(
                f"ModelConfig: `topk` must be in 1..num_experts={self.num_experts}, got {self.topk}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def named(cls, size: str, **overrides: Any) -> ModelConfig:
        """The config of a named size (a key of ``SIZES``: ``tiny``, ``small``, ``medium``,
        ``large``, ``xl``, ``2.7B``), with any field overridden:
        ``ModelConfig.named("xl", attention="flash")``.

        Raises:
            ValueError: ``size`` is not a key of ``SIZES``, or an override is not a valid value
                of its field (see the class).
        """
        if size not in SIZES:
            raise ValueError(
                f"ModelConfig.named: `size` must be one of {list(SIZES)}, got {size!r}"
            )
        d_model, d_ff, num_layers, num_heads = SIZES[size]
        sizes = dict(d_model=d_model, d_ff=d_ff, num_layers=num_layers, num_heads=num_heads)
        return cls(**(sizes | overrides))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)
