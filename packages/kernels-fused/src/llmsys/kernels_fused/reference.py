"""The executable specs: each fused op in plain eager PyTorch. Tests and benchmarks compare
against these."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --- fused linear cross-entropy -------------------------------------------------------------------


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` as a Hugging Face causal LM computes it.

    The logits come out of the matmul in its dtype (under ``torch.autocast``: the autocast
    dtype), are upcast to float32 (float64 logits stay float64) and go to ``F.cross_entropy``.
    This materialises the full (N, V) logits; ``linear_cross_entropy`` never does.

    Args:
        hidden: (..., H) floating.
        weight: (V, H), the lm_head weight.
        target: (...) int64 class indices, or ``ignore_index``.
        bias: optional (V,).
        ignore_index, label_smoothing, reduction: as ``F.cross_entropy``.

    Returns:
        The loss: 0-d for "mean" and "sum", (...) for "none"; float32 (float64 for float64).
    """
    logits = F.linear(hidden, weight, bias)
    if logits.dtype != torch.float64:
        logits = logits.float()
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss
