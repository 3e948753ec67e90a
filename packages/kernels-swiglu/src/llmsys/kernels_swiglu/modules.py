"""``nn.Module`` wrappers."""

from __future__ import annotations

import torch
from torch import nn

from llmsys.triton_launch import checks

from .functional import swiglu


class SwiGLUFeedForward(nn.Module):
    """LLaMA-style feed-forward block: ``w2(swiglu(w1(x), w3(x)))``, no biases.

    Args:
        d_model: input and output width.
        d_ff: hidden width (LLaMA uses about ``8/3 * d_model``, rounded to a multiple of 64).
        device, dtype: for the three weight matrices.

    Shapes: ``x`` (..., d_model) -> (..., d_model).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("d_ff", d_ff)):
            checks.positive_int("SwiGLUFeedForward", name, value)
        self.d_model, self.d_ff = d_model, d_ff
        factory = {"device": device, "dtype": dtype}
        self.w1 = nn.Linear(d_model, d_ff, bias=False, **factory)  # gate
        self.w3 = nn.Linear(d_model, d_ff, bias=False, **factory)  # up
        self.w2 = nn.Linear(d_ff, d_model, bias=False, **factory)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))  # (..., d_ff) -> (..., d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_ff={self.d_ff}"
