"""FLOPs of the Transformer LM and the GPU peaks that model FLOPs utilization (MFU) divides by.

Counting rule: only matmul FLOPs, 2 per multiply-add; the backward costs twice the forward;
recomputation from activation checkpointing is *not* counted (MFU measures useful work), as in
PaLM's appendix B. Unlike PaLM (and llm.c / nanochat, which count the full T x T score matrix),
causal attention counts only the half that is needed (the ``q k^T`` and ``p v`` products over
``T (T + 1) / 2`` pairs): at xl and context 1024 that gives an MFU about 1.3 points lower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import ModelConfig
from .hardware import HARDWARE

# Dense peaks in TFLOP/s by a pattern of ``torch.cuda.get_device_name()``, the more specific
# names first; one source of truth: the datasheet figures in ``hardware.HARDWARE``.
PEAK_TFLOPS = {
    name: {precision: flops / 1e12 for precision, flops in spec.matmul_flops.items()}
    for name, spec in HARDWARE.items()
}
MODES = ("forward", "forward-backward", "train-step")
PRECISIONS = ("bf16", "tf32", "fp32")


def forward_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Matmul FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens."""
    tokens = batch_size * seq_len
    d, d_ff = config.d_model, config.d_ff
    attention_proj = 4 * d * d  # qkv (3 d^2) and output (d^2) weights
    ffn = 3 * d * d_ff * (config.topk if config.ffn == "moe" else 1)
    router = d * config.num_experts if config.ffn == "moe" else 0
    per_layer: float = 2 * tokens * (attention_proj + ffn + router)
    per_layer += _causal_attention_flops(batch_size, seq_len, config.num_heads, config.head_dim)
    return config.num_layers * per_layer + 2 * tokens * d * config.vocab_size  # + lm_head


def _causal_attention_flops(batch_size: int, seq_len: int, heads: int, head_dim: int) -> float:
    """``q k^T`` and ``p v`` over the causal (query, key) pairs of every sequence and head."""
    pairs = seq_len * (seq_len + 1) / 2
    return 2 * 2 * batch_size * heads * pairs * head_dim


def llama_forward_flops(sizes: Mapping[str, Any], batch_size: int, seq_len: int) -> float:
    """Matmul FLOPs of one forward pass of a Hugging Face Llama of ``sizes`` (its
    ``LlamaConfig`` fields, as ``memory_model.from_llama`` reads them) over ``batch_size``
    sequences of ``seq_len`` tokens: :func:`forward_flops`'s count with grouped-query attention
    (k and v projections ``num_key_value_heads`` heads wide).

    Raises:
        KeyError: ``sizes`` lacks one of the fields.
    """
    tokens = batch_size * seq_len
    d, d_ff = sizes["hidden_size"], sizes["intermediate_size"]
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    head_dim = d // heads
    projections = 2 * d * d + 2 * d * kv_heads * head_dim  # q and o, k and v
    per_layer = 2 * tokens * (projections + 3 * d * d_ff)
    per_layer += _causal_attention_flops(batch_size, seq_len, heads, head_dim)
    return sizes["num_hidden_layers"] * per_layer + 2 * tokens * d * sizes["vocab_size"]


def step_flops(config: ModelConfig, batch_size: int, seq_len: int, mode: str) -> float:
    """FLOPs of a ``forward``, ``forward-backward`` or ``train-step`` (3x forward for both)."""
    if mode not in MODES:
        raise ValueError(f"step_flops: `mode` must be one of {MODES}, got {mode!r}")
    return forward_flops(config, batch_size, seq_len) * (1 if mode == "forward" else 3)


def matmul_precision(dtype: str, *, always_tf32: bool = False) -> str:
    """The precision matmuls run in: "bf16" for ``dtype="bf16"``; for "fp32", "tf32" when
    PyTorch lets matmuls use TF32 (``torch.backends.cuda.matmul.allow_tf32``) or the kernel
    always does (``always_tf32``, e.g. Triton's fp32 dots), else "fp32"."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"matmul_precision: `dtype` must be 'bf16' or 'fp32', got {dtype!r}")
    if not isinstance(always_tf32, bool):
        raise TypeError(
            f"matmul_precision: `always_tf32` must be a bool, got {type(always_tf32).__name__}"
        )
    if dtype == "bf16":
        return "bf16"
    return "tf32" if always_tf32 or torch.backends.cuda.matmul.allow_tf32 else "fp32"


def peak_flops(device_name: str, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, its description) of ``device_name`` (``torch.cuda.get_device_name()``) in
    ``precision`` ("bf16", "tf32" or "fp32"), or (None, why not) for an unknown device."""
    if precision not in PRECISIONS:
        raise ValueError(f"peak_flops: `precision` must be one of {PRECISIONS}, got {precision!r}")
    for pattern, peaks in PEAK_TFLOPS.items():  # the more specific names come first
        if pattern.lower() in device_name.lower():
            tflops = peaks[precision]
            return tflops * 1e12, f"{pattern} dense {precision} {tflops:.1f} TFLOP/s"
    return None, f"no {precision} peak known for {device_name!r}"
