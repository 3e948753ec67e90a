"""The public, differentiable SwiGLU function, and the autograd of ``swiglu_fwd``."""

from __future__ import annotations

from typing import Any

import torch

from llmsys.triton_launch import call_below_autograd, checks, refuse_double_backward, wants_grad

from . import ops  # registers torch.ops.llm_scaling_week.*


def _setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_double_backward("swiglu")
    a, b = ctx.saved_tensors
    return call_below_autograd(ops.swiglu_bwd, grad_out, a, b)


class _SwiGLUFunction(torch.autograd.Function):
    """``swiglu_fwd`` forward; both gradients from one ``swiglu_bwd`` pass."""

    # forward takes ctx itself: with a separate setup_context, Function.apply binds every
    # call's arguments through inspect.signature (tens of microseconds of host time a call).
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = call_below_autograd(ops.swiglu_fwd, a, b)
        _setup_context(ctx, (a, b), out)
        return out

    backward = staticmethod(_backward)


# torch.ops.llm_scaling_week.swiglu_fwd called by name is differentiable the same way.
torch.library.register_autograd(ops.swiglu_fwd, _backward, setup_context=_setup_context)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Fused ``silu(a) * b`` with a fused Triton backward.

    Args:
        a: gate input (e.g. ``x @ w1.T``), any shape, dtype float16, bfloat16, float32 or float64,
            on CUDA (Triton kernel) or CPU (eager reference, or the Triton kernel under
            ``TRITON_INTERPRET=1``).
        b: up input (e.g. ``x @ w3.T``), the same shape, dtype and device as ``a``.

    Returns:
        A new contiguous tensor of ``a``'s shape and dtype. It equals eager ``F.silu(a) * b``
        bit for bit in float16 and bfloat16 (silu is rounded to the input dtype before the
        multiply, as eager does). Non-contiguous inputs are copied to contiguous ones first.

    Raises:
        TypeError: an argument is not a tensor, or the dtypes are unsupported or differ.
        ValueError: the shapes or devices differ.

    Both gradients come from one Triton pass (``torch.ops.llm_scaling_week.swiglu_bwd``); the op
    works under ``torch.compile(fullgraph=True)`` and in CUDA graphs. Double backward is not
    supported: a backward with ``create_graph=True`` raises a ``RuntimeError``.
    """
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        ops.check_inputs("swiglu", a=a, b=b)  # a TypeError naming the argument
    try:
        if wants_grad(a, b):
            return _SwiGLUFunction.apply(a, b)
        return call_below_autograd(ops.swiglu_fwd, a, b)
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "swiglu") from None
