"""``Int8Linear``: an inference-only W8A8 drop-in for ``nn.Linear``, and ``quantize_linears``."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from llmsys.triton_launch import call_below_autograd, checks

from . import ops
from .functional import quantize_int8_perrow  # (importing functional registers the ops' autograd)

logger = logging.getLogger(__name__)


_FLOAT_DTYPES = frozenset(ops.FLOAT_DTYPES)


class Int8Linear(nn.Module):
    """``y = x @ W.T + bias`` with W quantized once per output channel and x per token.

    Each call quantizes the rows of ``x`` (one Triton pass) and runs the int8 tensor-core GEMM
    with the fp32 epilogue ``acc * x_scale[m] * w_scale[n] + bias[n]``. Inference-only: a call
    with grad mode on and an ``x`` that requires grad raises ``RuntimeError``.

    A token (row of ``x``) holding a NaN or Inf gives NaN in every output of that token, as the
    float layer would give non-finite outputs; with ``check_finite=True`` the call raises
    ``ValueError`` naming the row instead (a device synchronization, skipped inside CUDA-graph
    capture and torch.compile).

    Args:
        in_features: K.
        out_features: N.
        bias: whether to keep a bias (N,). Default True.
        device: where the buffers live.
        dtype: the dtype of ``weight_scale`` and ``bias`` (float16, bfloat16 or float32).
            Default float16.
        check_finite: refuse inputs holding a NaN or Inf (see above). Default False.

    Buffers: ``qweight`` (N, K) int8 (the layout of ``nn.Linear.weight``, so ``qweight.t()`` is
    the column-major (K, N) operand the GEMM reads fastest), ``weight_scale`` (N,), ``bias`` (N,)
    or None. Build one from a float layer with :meth:`from_float`.

    Shapes: ``x`` (..., K) float16/bfloat16/float32 -> (..., N) in ``x.dtype``.

    Raises:
        TypeError: ``dtype`` is not float16, bfloat16 or float32, or ``check_finite`` is not a
            bool.
        ValueError: ``in_features`` or ``out_features`` is not a positive int.
    """

    qweight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.types.Device = None,
        dtype: torch.dtype = torch.float16,
        check_finite: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            checks.positive_int("Int8Linear", name, value)
        checks.flag("Int8Linear", "check_finite", check_finite)
        self.check_finite = check_finite
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
    def from_float(cls, linear: nn.Linear, *, check_finite: bool = False) -> Int8Linear:
        """Quantize ``linear``'s weight once, per output channel; the bias is kept as is.

        A weight row (output channel) holding a NaN or Inf gets a NaN scale, so that output is
        NaN for every token; with ``check_finite=True`` this raises ``ValueError`` naming the
        row instead, and the module refuses non-finite inputs too.

        Args:
            linear: an ``nn.Linear`` with a float16, bfloat16 or float32 weight.
            check_finite: see above. Default False.

        Returns:
            An ``Int8Linear`` on the weight's device, ``weight_scale`` in the weight's dtype.

        Raises:
            TypeError: ``linear`` is not an ``nn.Linear`` with a float16, bfloat16 or float32
                weight, or ``check_finite`` is not a bool.
            ValueError: ``check_finite=True`` and a weight row holds a NaN or Inf.
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
            check_finite=check_finite,
        )
        if check_finite:
            ops.check_finite_rows("Int8Linear.from_float", "linear.weight", weight)
        qweight, scale = quantize_int8_perrow(weight)  # per output channel: (N, K), (N,)
        module.qweight.copy_(qweight)
        module.weight_scale.copy_(scale)
        if linear.bias is not None:
            module.bias = linear.bias.detach().clone()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + bias`` in ``x.dtype``.

        Raises:
            TypeError: ``x`` is not a float16, bfloat16 or float32 tensor.
            ValueError: ``x``'s last dim is not ``in_features``, or ``check_finite`` is on and
                a row of ``x`` holds a NaN or Inf.
            RuntimeError: grad mode is on and ``x`` requires grad (inference-only).
        """
        if not (type(x) is torch.Tensor and x.dtype in _FLOAT_DTYPES):
            checks.tensor("Int8Linear", "x", x, ops.FLOAT_DTYPES)
        if x.requires_grad and torch.is_grad_enabled():
            raise ops.inference_only_error("Int8Linear")
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Int8Linear: `x` must have shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        two_d = x.dim() == 2
        rows = x if two_d else x.reshape(-1, self.in_features)  # (M, K)
        if self.check_finite:
            ops.check_finite_rows("Int8Linear", "x", rows)
        # One op (quantize, then multiply), called below autograd as the public functions call
        # theirs, without their own argument checks (host time per call, issue 25). A buffer
        # that requires grad makes the op refuse, naming it. The buffers are read from
        # `_buffers` directly: nn.Module's attribute lookup costs about a microsecond each.
        try:
            buffers: dict[str, Any] = self._buffers  # (qweight is never None)
            qweight, scale, bias = buffers["qweight"], buffers["weight_scale"], buffers["bias"]
        except KeyError:  # one replaced by a parameter or a parametrization: the full lookup
            qweight, scale, bias = self.qweight, self.weight_scale, self.bias
        out = call_below_autograd(
            ops.int8_matmul_quantize, rows, qweight.t(), scale, bias
        )  # (M, N)
        return out if two_d else out.reshape(*x.shape[:-1], self.out_features)

    def forward_quantized(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The layer on rows already quantized per token: one GEMM, no quantization pass.

        For producers that quantize as they write, such as :func:`rms_norm_quantize_int8` or
        :func:`silu_mul_quantize_int8`; ``forward(x)`` equals
        ``forward_quantized(*quantize_int8_perrow(x))`` for 2-D ``x``.

        Args:
            q: (M, K) int8, row-major fastest.
            scale: (M,) float16, bfloat16 or float32, per row; its dtype is the output dtype.

        Returns:
            (M, N) in ``scale.dtype``.

        Raises:
            TypeError, ValueError: as :func:`matmul_int8`, naming ``a`` (``q``) and ``a_scale``
                (``scale``).
            RuntimeError: grad mode is on and ``scale`` requires grad (inference-only).
        """
        checks.tensors("matmul_int8", a=q, a_scale=scale)  # before the dispatcher's own error
        if scale.requires_grad and torch.is_grad_enabled():
            raise ops.inference_only_error("matmul_int8")
        return call_below_autograd(
            ops.int8_matmul, q, scale, self.qweight.t(), self.weight_scale, self.bias
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scale_dtype={self.weight_scale.dtype}"
            + (", check_finite=True" if self.check_finite else "")
        )


Include = str | Iterable[str] | Callable[[str, nn.Linear], bool] | None
ModuleT = TypeVar("ModuleT", bound=nn.Module)  # quantize_linears returns the model it took


def quantize_linears(
    model: ModuleT, include: Include = None, *, check_finite: bool = False
) -> ModuleT:
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
        check_finite: passed to every :meth:`Int8Linear.from_float`. Default False.

    Returns:
        ``model`` itself, modified in place. The names of the swapped layers are logged
        (``logging`` INFO, logger ``llmsys.kernels_int8.modules``).

    Raises:
        TypeError: ``model`` is not a module, ``include`` not one of the forms above.
        ValueError: ``model`` is an ``nn.Linear``, or no layer would be swapped (``include``
            matched no ``nn.Linear``, or the model has none): nothing is changed then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_linears: `model` must be an nn.Module, got {type(model)}")
    if isinstance(model, nn.Linear):
        raise ValueError(
            "quantize_linears: `model` is itself an nn.Linear and cannot be swapped in place; "
            "use Int8Linear.from_float(model)"
        )
    checks.flag("quantize_linears", "check_finite", check_finite)
    selected = _selector(include)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    chosen = [(name, module) for name, module in linears if selected(name, module)]
    if not chosen:
        found = f"{len(linears)} nn.Linear layer(s)" if linears else "no nn.Linear layer"
        raise ValueError(
            f"quantize_linears: `include` ({include!r}) must select at least one nn.Linear of "
            f"`model` ({type(model).__name__}, which has {found}); nothing was swapped"
        )
    # Quantize every chosen layer before swapping any, so a refusal leaves the model unchanged.
    swaps = [(name, Int8Linear.from_float(m, check_finite=check_finite)) for name, m in chosen]
    for name, int8_linear in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, int8_linear)
    names = [name for name, _ in swaps]
    logger.info("quantize_linears: swapped %d nn.Linear for Int8Linear: %s", len(names), names)
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
