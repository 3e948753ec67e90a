"""``Int8Linear``: an inference-only W8A8 drop-in for ``nn.Linear``, and ``quantize_linears``."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from llmsys.triton_launch import checks

from . import ops
from .functional import matmul_int8, quantize_int8_perrow


class Int8Linear(nn.Module):
    """``y = x @ W.T + bias`` with W quantized once per output channel and x per token.

    Each call quantizes the rows of ``x`` (one Triton pass) and runs the int8 tensor-core GEMM
    with the fp32 epilogue ``acc * x_scale[m] * w_scale[n] + bias[n]``. Inference-only: a call
    with grad mode on and an ``x`` that requires grad raises ``RuntimeError``.

    Args:
        in_features: K.
        out_features: N.
        bias: whether to keep a bias (N,). Default True.
        device: where the buffers live.
        dtype: the dtype of ``weight_scale`` and ``bias`` (float16, bfloat16 or float32).
            Default float16.

    Buffers: ``qweight`` (N, K) int8 (the layout of ``nn.Linear.weight``, so ``qweight.t()`` is
    the column-major (K, N) operand the GEMM reads fastest), ``weight_scale`` (N,), ``bias`` (N,)
    or None. Build one from a float layer with :meth:`from_float`.

    Shapes: ``x`` (..., K) float16/bfloat16/float32 -> (..., N) in ``x.dtype``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device=None,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            checks.positive_int("Int8Linear", name, value)
        if dtype not in ops.FLOAT_DTYPES:
            raise TypeError(
                f"Int8Linear: `dtype` must be float16, bfloat16 or float32, got {dtype}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        )
        self.register_buffer("weight_scale", torch.zeros(out_features, dtype=dtype, device=device))
        self.register_buffer(
            "bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        )

    @classmethod
    @torch.no_grad()
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize ``linear``'s weight once, per output channel; the bias is kept as is.

        Args:
            linear: an ``nn.Linear`` with a float16, bfloat16 or float32 weight.

        Returns:
            An ``Int8Linear`` on the weight's device, ``weight_scale`` in the weight's dtype.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"Int8Linear.from_float: `linear` must be an nn.Linear, got {type(linear).__name__}"
            )
        weight = linear.weight.detach()  # (N, K)
        if weight.dtype not in ops.FLOAT_DTYPES:
            raise TypeError(
                "Int8Linear.from_float: `linear` weight must be float16, bfloat16 or float32, "
                f"got {weight.dtype}"
            )
        module = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        qweight, scale = quantize_int8_perrow(weight)  # per output channel: (N, K), (N,)
        module.qweight.copy_(qweight)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            raise ops.inference_only_error("Int8Linear")
        if isinstance(x, torch.Tensor) and (x.dim() < 1 or x.shape[-1] != self.in_features):
            raise ValueError(
                f"Int8Linear: `x` must have shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        q, scale = quantize_int8_perrow(x.reshape(math.prod(lead), self.in_features))  # (M, K)
        out = matmul_int8(q, scale, self.qweight.t(), self.weight_scale, bias=self.bias)  # (M, N)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scale_dtype={self.weight_scale.dtype}"
        )


Include = str | Iterable[str] | Callable[[str, nn.Linear], bool] | None


def quantize_linears(model: nn.Module, include: Include = None) -> nn.Module:
    """Swap ``nn.Linear`` layers of ``model`` in place for :class:`Int8Linear` (inference).

    Args:
        model: any module; it must not itself be an ``nn.Linear`` (use
            ``Int8Linear.from_float``).
        include: which layers to swap, by qualified name (as ``model.named_modules()`` gives it):
            None (default) swaps every layer whose type is exactly ``nn.Linear``; a string or a
            list of strings are ``fnmatch`` patterns (``"*.mlp.*"``, ``"layers.0.proj"``); a
            callable ``include(name, linear) -> bool`` decides per layer. Subclasses of
            ``nn.Linear`` (e.g. inside ``nn.MultiheadAttention``, which reads the weight
            directly) are never swapped.

    Returns:
        ``model`` itself, modified in place.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_linears: `model` must be an nn.Module, got {type(model)}")
    if isinstance(model, nn.Linear):
        raise ValueError(
            "quantize_linears: `model` is itself an nn.Linear and cannot be swapped in place; "
            "use Int8Linear.from_float(model)"
        )
    selected = _selector(include)
    chosen = [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear and selected(name, module)
    ]
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Int8Linear.from_float(getattr(parent, child)))
    return model


def _selector(include: Include) -> Callable[[str, nn.Linear], bool]:
    if include is None:
        return lambda name, module: True
    if callable(include):
        return include
    patterns = [include] if isinstance(include, str) else list(include)
    if not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            "quantize_linears: `include` must be None, a pattern string, a list of pattern "
            f"strings or a callable, got {include!r}"
        )
    return lambda name, module: any(fnmatch.fnmatchcase(name, p) for p in patterns)
