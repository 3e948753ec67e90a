"""``nn.Module`` wrappers of the fused ops."""

from __future__ import annotations

import torch
from torch import nn

from llmsys.triton_launch import checks

from .rms_norm import DTYPES, rms_norm


class LlamaStyleRMSNorm(nn.Module):
    """A drop-in for transformers' ``LlamaRMSNorm``: the same attributes (``weight``, ones at
    first, and ``variance_epsilon``), the same state dict, the Triton :func:`rms_norm`.

    Named for that formula: the normalised value is rounded to the input's dtype before the
    weight multiplies it (``torch.nn.RMSNorm`` multiplies first, and calls its epsilon ``eps``).
    ``RMSNorm`` is the same class under its earlier name.

    Args:
        hidden_size: N, the size of the normalised last dim.
        eps: added to the mean square. Default 1e-6.
        device, dtype: of ``weight`` (default: torch's defaults); ``dtype`` one that
            :func:`rms_norm` takes, float16, bfloat16 or float32 (else ``TypeError``).

    ``forward(hidden_states, residual=None)`` returns ``rms_norm(hidden_states, weight, eps)``,
    or with ``residual`` the pair ``(normalised, hidden_states + residual)``.

    Raises:
        TypeError: ``dtype`` is not None, float16, bfloat16 or float32.
        ValueError: ``hidden_size`` is not a positive int.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        checks.positive_int("LlamaStyleRMSNorm", "hidden_size", hidden_size)
        if dtype is not None and dtype not in DTYPES:
            raise TypeError(
                f"LlamaStyleRMSNorm: `dtype` must be None or one of ({checks.dtype_names(DTYPES)}),"
                f" got {dtype}"
            )
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(
        self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


RMSNorm = LlamaStyleRMSNorm  # the earlier name, which shadowed torch.nn.RMSNorm
