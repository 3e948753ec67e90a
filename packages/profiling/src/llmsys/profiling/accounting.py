"""FLOPs of the Transformer LM and the GPU peaks that model FLOPs utilization (MFU) divides by.

Counting rule (the one MFU papers use, PaLM appendix B): only matmul FLOPs, 2 per multiply-add;
the backward costs twice the forward; recomputation from activation checkpointing is *not*
counted (MFU measures useful work). Causal attention counts the half of the score matrix that
is needed (the ``q k^T`` and ``p v`` products over ``T (T + 1) / 2`` pairs).
"""

from __future__ import annotations

import torch

from .config import ModelConfig

# Dense peaks in TFLOP/s from the vendors' datasheets (without sparsity).
# H100 SXM5 / H200 SXM: NVIDIA H100 and H200 datasheets; A100 SXM: NVIDIA A100 datasheet.
PEAK_TFLOPS = {
    "h100": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h200": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "a100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def forward_flops(config: ModelConfig, batch_size: int, seq_len: int) -> float:
    """Matmul FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens."""
    tokens = batch_size * seq_len
    d, d_ff = config.d_model, config.d_ff
    attention_proj = 4 * d * d  # qkv (3 d^2) and output (d^2) weights
    ffn = 3 * d * d_ff * (config.topk if config.ffn == "moe" else 1)
    router = d * config.num_experts if config.ffn == "moe" else 0
    per_layer = 2 * tokens * (attention_proj + ffn + router)
    pairs = seq_len * (seq_len + 1) / 2  # causal (query, key) pairs per sequence and head
    per_layer += 2 * 2 * batch_size * config.num_heads * pairs * config.head_dim  # qk^T and pv
    return config.num_layers * per_layer + 2 * tokens * d * config.vocab_size  # + lm_head


def step_flops(config: ModelConfig, batch_size: int, seq_len: int, mode: str) -> float:
    """FLOPs of a ``forward``, ``forward-backward`` or ``train-step`` (3x forward for both)."""
    return forward_flops(config, batch_size, seq_len) * (1 if mode == "forward" else 3)


def peak_flops(gpu_slug: str, dtype: str) -> tuple[float | None, str]:
    """(peak FLOP/s, its name) for the matmul precision a run uses, or (None, why not).

    ``dtype`` "bf16" uses the dense bf16 tensor-core peak; "fp32" the TF32 peak when PyTorch
    lets matmuls use TF32 (``torch.backends.cuda.matmul.allow_tf32``), else plain FP32.
    """
    peaks = PEAK_TFLOPS.get(gpu_slug)
    if peaks is None:
        return None, f"no peak known for {gpu_slug!r}"
    if dtype == "bf16":
        kind = "bf16"
    else:
        kind = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return peaks[kind] * 1e12, f"{gpu_slug} dense {kind} {peaks[kind]:.1f} TFLOP/s"
