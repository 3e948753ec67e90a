"""``nn.Module`` wrappers."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmsys.kernels_swiglu import swiglu
from llmsys.triton_launch import checks

from .functional import moe_unpermute, padded_moe_permute


class MoEFeedForward(nn.Module):
    """Top-k mixture of SwiGLU experts: router, permute, one FFN per expert, weighted unpermute.

    ``y[t] = sum_k w[t, k] * FFN_{e(t, k)}(x[t])`` with ``FFN_e(h) = w2[e] (silu(w1[e] h) *
    w3[e] h)``; ``e(t, :)`` are the ``topk`` largest router logits and ``w[t, :]`` their softmax
    (Mixtral's routing). Each expert's FFN runs on its padded group of
    :func:`padded_moe_permute` (padding rows are zeros and are never read back).

    Args:
        d_model: input and output width.
        d_ff: hidden width of each expert.
        num_experts: number of experts.
        topk: experts per token, at most ``num_experts``.
        align: group alignment of the permute (default 128, what FP8 grouped GEMMs need).
        device, dtype: for the parameters.

    Shapes: ``x`` (..., d_model) -> (..., d_model). The forward syncs with the host once (the
    group sizes for the per-expert matmuls), plus the permute's own sync.

    Raises:
        ValueError: a size is not a positive int, or ``topk`` is above ``num_experts``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        topk: int,
        *,
        align: int = 128,
        device: torch.types.Device = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("d_ff", d_ff),
            ("num_experts", num_experts),
            ("topk", topk),
            ("align", align),
        ):
            checks.positive_int("MoEFeedForward", name, value)
        if topk > num_experts:
            raise ValueError(
                f"MoEFeedForward: `topk` must be at most num_experts={num_experts}, got {topk}"
            )
        self.d_model, self.d_ff = d_model, d_ff
        self.num_experts, self.topk, self.align = num_experts, topk, align
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.router = nn.Linear(d_model, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(num_experts, d_ff, d_model, **factory))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, d_ff, d_model, **factory))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, d_ff, **factory))  # down
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default: uniform in +-1/sqrt(fan_in), per expert.
        for weight in (self.w1, self.w3, self.w2):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)
        self.router.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.d_model)  # (T, d_model)
        logits = self.router(tokens)  # (T, E)
        top_logits, top_experts = logits.topk(self.topk, dim=-1)  # (T, k)
        weights = torch.softmax(top_logits.float(), dim=-1).to(x.dtype)  # (T, k)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, top_experts.reshape(-1), torch.ones_like(top_experts.reshape(-1)))
        grouped, padded, row_index = padded_moe_permute(
            tokens, top_experts, counts, self.topk, self.num_experts,
            align=self.align, return_row_index=True,
        )  # fmt: skip  # grouped: (rows, d_model)
        outputs = []
        for e, group in enumerate(grouped.split(padded.tolist())):  # the group sizes: a sync
            if group.shape[0]:
                hidden = swiglu(group @ self.w1[e].T, group @ self.w3[e].T)  # (n_e, d_ff)
                outputs.append(hidden @ self.w2[e].T)  # (n_e, d_model)
        expert_out = torch.cat(outputs) if outputs else grouped  # (rows, d_model)
        return moe_unpermute(expert_out, row_index, weights).reshape(x.shape)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_ff={self.d_ff}, num_experts={self.num_experts}, "
            f"topk={self.topk}, align={self.align}"
        )
