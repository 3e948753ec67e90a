"""Input checks, the launcher and the ``torch.ops.llm_scaling_week`` registrations.

    swiglu_fwd(Tensor a, Tensor b) -> Tensor
    swiglu_bwd(Tensor grad_out, Tensor a, Tensor b) -> (Tensor, Tensor)

Registered and launched the way every llmsys kernel package does it (``llmsys.triton_launch``);
``swiglu_fwd``'s autograd (its backward is ``swiglu_bwd``) is in functional.py.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl

from llmsys.triton_launch import cdiv, checks, define_op, launch, runs_under_interpreter

from .kernels import swiglu_bwd_kernel, swiglu_fwd_kernel
from .reference import swiglu_backward_reference, swiglu_reference

NAMESPACE = "llm_scaling_week"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(swiglu_fwd_kernel)


def check_inputs(op: str, **tensors: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless all tensors match."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        checks.tensor(op, name, t, SUPPORTED_DTYPES)
        checks.same_dtype(op, name, t, first_name, first)
        checks.same_shape(op, name, t, first_name, first)
        checks.same_device(op, name, t, first_name, first)


def launch_config(n_elements: int) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for a flat tensor of ``n_elements``.

    Measured kernel by kernel on an H100 (DECISIONS.md): 512 elements per program on 4 warps
    is the fastest or within 1% of it up to 16M at sizes with a partial last program; 1024 and
    more made the masked last program of an odd size (1000x1001) the slowest of the launch (4.2
    us against 2.7 at 4096). A tensor of at most 128 elements takes one program of 128 on 4
    warps, one element per thread: the seed's 7x3x5 ran its masked program in 1.22 us of
    kernel time, against 1.73 us as 512 on 4 warps (the CUDA profiler, H100, 2026-12-07).
    From 2**20 elements in whole programs of 4096 (1024x1024), and from 2**24 elements at any
    size, 4096 per program on 8 warps: the configuration before 0.3.0
    there, which ran 1024x1024 bf16 6-11% faster than 512 (kernels-swiglu sweep, 2026-11-26).
    Code that replaces it calls ``llmsys.triton_launch.forget(swiglu_fwd, swiglu_bwd)`` after
    the change and after undoing it: a recorded replay launches the configuration it recorded.
    """
    if n_elements <= 128:
        return 128, 4
    if n_elements >= 1 << 24 or (n_elements >= 1 << 20 and n_elements % 4096 == 0):
        return 4096, 8
    return 512, 4


def _launch(kernel: Any, tensors: tuple[torch.Tensor, ...]) -> None:
    """Launch an elementwise ``kernel`` over ``tensors`` (contiguous, the first one's size)."""
    first = tensors[0]
    n = first.numel()
    block, num_warps = launch_config(n)
    constexprs = {
        "COMPUTE_DTYPE": tl.float64 if first.dtype is torch.float64 else tl.float32,
        "PRECISE": first.is_cuda,  # libdevice's exp; the interpreter has none
        "BLOCK_SIZE": block,
    }
    launch(kernel, cdiv(n, block), (*tensors, n), constexprs, num_warps=num_warps)


def _swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_inputs("swiglu_fwd", a=a, b=b)
    if not a.is_cuda and not CPU_RUNS_TRITON:
        return swiglu_reference(a, b).contiguous()
    a, b = a.contiguous(), b.contiguous()  # non-contiguous inputs cost one copy each
    out = torch.empty_like(a, memory_format=torch.contiguous_format)
    _launch(swiglu_fwd_kernel, (a, b, out))
    return out


def _swiglu_bwd(
    grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("swiglu_bwd", a=a, b=b, grad_out=grad_out)
    if not a.is_cuda and not CPU_RUNS_TRITON:
        grad_a, grad_b = swiglu_backward_reference(grad_out, a, b)
        return grad_a.contiguous(), grad_b.contiguous()
    grad_out, a, b = grad_out.contiguous(), a.contiguous(), b.contiguous()
    grad_a = torch.empty_like(a, memory_format=torch.contiguous_format)
    grad_b = torch.empty_like(b, memory_format=torch.contiguous_format)
    _launch(swiglu_bwd_kernel, (grad_out, a, b, grad_a, grad_b))
    return grad_a, grad_b


def _swiglu_fwd_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_inputs("swiglu_fwd", a=a, b=b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


def _swiglu_bwd_fake(
    grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("swiglu_bwd", a=a, b=b, grad_out=grad_out)
    empty = torch.empty_like(a, memory_format=torch.contiguous_format)
    return empty, torch.empty_like(empty)


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
swiglu_fwd = define_op(
    _lib,
    "swiglu_fwd(Tensor a, Tensor b) -> Tensor",
    _swiglu_fwd,
    _swiglu_fwd_fake,
    replays=True,
)
swiglu_bwd = define_op(
    _lib,
    "swiglu_bwd(Tensor grad_out, Tensor a, Tensor b) -> (Tensor, Tensor)",
    _swiglu_bwd,
    _swiglu_bwd_fake,
    replays=True,
)
