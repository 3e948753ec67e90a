"""What every benchmark does with the model: random batches, mixed precision, loss, optimizer.

These are the same few lines a training script has; the benchmarks share them so that a forward,
a backward and an optimizer step mean the same thing in ``e2e``, ``memory`` and ``profile``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from .config import ModelConfig

DTYPES = ("fp32", "bf16")  # bf16 = float32 weights under torch.autocast(bfloat16)
OPTIMIZERS = ("adamw-fused", "adamw-foreach", "adamw-llmsys")
# AdamW's settings in every benchmark (lr 1e-4 unless one asks for another)
ADAMW: dict[str, Any] = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


def autocast(dtype: str, device: str | torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bfloat16 for ``dtype="bf16"``; nothing for ``"fp32"``."""
    if dtype not in DTYPES:
        raise ValueError(f"autocast: `dtype` must be one of {DTYPES}, got {dtype!r}")
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def random_batch(
    config: ModelConfig, batch_size: int, seq_len: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (tokens, next-token targets), each (batch_size, seq_len) int64."""
    if seq_len > config.context_length:
        raise ValueError(
            f"random_batch: `seq_len` must be at most context_length={config.context_length}, "
            f"got {seq_len}"
        )
    data = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
    return data[:, :-1], data[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def step_loss(
    model: Callable[..., torch.Tensor],
    config: ModelConfig,
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """The loss of a benchmark step: ``lm_loss(model(tokens), targets)`` with the logits, or,
    for ``config.loss == "fused"``, ``model(tokens, targets)``, which never builds them.

    ``model`` is the ``TransformerLM`` of ``config`` or its ``torch.compile`` wrapper. The eager
    loss stays outside the model's forward, as it always was, so the committed baselines
    (eager and compiled) time the same graph.
    """
    if config.loss == "fused":
        return model(tokens, targets)
    return lm_loss(model(tokens), targets)


def make_optimizer(
    model: torch.nn.Module, name: str = "adamw-fused", lr: float = 1e-4
) -> torch.optim.Optimizer:
    """AdamW (weight decay 0.1, betas (0.9, 0.95)) over ``model``'s parameters.

    ``name``: "adamw-fused" (PyTorch's fused CUDA kernel; foreach on CPU), "adamw-foreach"
    (PyTorch's multi-tensor loops) or "adamw-llmsys" (this package's readable
    :class:`~llmsys.profiling.optimizer.AdamW`, one parameter at a time).
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"make_optimizer: `name` must be one of {OPTIMIZERS}, got {name!r}")
    options: dict[str, Any] = ADAMW | dict(lr=lr)
    if name == "adamw-llmsys":
        from .optimizer import AdamW

        return AdamW(model.parameters(), **options)
    on_cuda = next(model.parameters()).is_cuda
    if name == "adamw-fused" and on_cuda:
        return torch.optim.AdamW(model.parameters(), fused=True, **options)
    return torch.optim.AdamW(model.parameters(), foreach=True, **options)


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


T = TypeVar("T")


def unless_out_of_memory(measure: Callable[[], T], device: str | torch.device) -> T | None:
    """``measure()``, or None when it runs out of device memory (a sweep records OOM and goes
    on); either way what it left behind is freed before the next case allocates."""
    try:
        return measure()
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        return None
    finally:
        free_device_memory(device)


def free_device_memory(device: str | torch.device) -> None:
    """Drop what the last case left: Python garbage, CUDA graphs that compiled models recorded
    (their private memory pools), and the allocator's cached blocks."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch._dynamo.reset()  # also releases torch.compile's CUDA-graph trees
        torch.cuda.empty_cache()


def is_out_of_memory(error: BaseException) -> bool:
    """True for CUDA out-of-memory errors, however PyTorch or cuBLAS phrased them."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or any(
        marker in text for marker in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED")
    )
