"""Launchers and the ``torch.ops.llm_scaling_week`` registrations.

The ops are registered with a lean ``torch.library.Library`` (define + impl + fake + an
Autograd-key kernel) rather than ``torch.library.custom_op``, and the CUDA launcher calls the
compiled Triton kernel directly once it has been compiled for a given specialization:
``JITFunction.run`` rebinds and re-specializes every argument on every call, which is most of a
small call's host cost.
"""

from __future__ import annotations

import torch
import triton

from .kernels import swiglu_bwd_kernel, swiglu_fwd_kernel
from .reference import swiglu_backward_reference, swiglu_reference

NAMESPACE = "llm_scaling_week"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)

_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
_lib.define("swiglu_fwd(Tensor a, Tensor b) -> Tensor")
_lib.define("swiglu_bwd(Tensor grad_out, Tensor a, Tensor b) -> (Tensor, Tensor)")

# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = type(swiglu_fwd_kernel).__name__ == "InterpretedFunction"


def check_inputs(op: str, **tensors: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless all tensors match."""
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise TypeError(f"{op}: `{name}` must have dtype in ({allowed}), got {t.dtype}")
        if t.dtype != first.dtype:
            raise TypeError(
                f"{op}: `{name}` must have the dtype of `{first_name}` ({first.dtype}), "
                f"got {t.dtype}"
            )
        if t.shape != first.shape:
            raise ValueError(
                f"{op}: `{name}` must have the shape of `{first_name}` "
                f"({tuple(first.shape)}), got {tuple(t.shape)}"
            )
        if t.device != first.device:
            raise ValueError(
                f"{op}: `{name}` must be on the device of `{first_name}` ({first.device}), "
                f"got {t.device}"
            )


def launch_config(n_elements: int) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for a flat tensor of ``n_elements``.

    Measured on an H100 (benchmarks/NOTES.md): small tensors want small blocks so that every
    SM has work; from 2**20 elements up, 4096 elements per program (16 per thread) was within
    1% of the best of 512 to 16384 in both dtypes.
    """
    if n_elements <= 1 << 18:
        return 1024, 4
    return 4096, 8


def _launch_hooks_installed() -> bool:
    hook = triton.knobs.runtime.launch_enter_hook  # a HookChain: never None, empty by default
    return bool(getattr(hook, "calls", hook))


# Compiled kernels keyed by everything Triton specializes on: dtype, device, 16-byte alignment
# of each pointer, and the size's divisibility by 16, value 1 and width. This is a specialized
# copy of llmsys.triton_launch.launch: the generic one's per-argument key cost 2.8 us more per
# call on our H100 host (11.2 vs 8.5 us; NOTES.md section 7), which the host-cost budget of a
# 128x128 call (1.2x eager's 15 us) cannot afford.
_compiled: dict[tuple, object] = {}


def _launch(kernel, tensors: tuple[torch.Tensor, ...], n: int) -> None:
    block, num_warps = launch_config(n)
    grid = (n + block - 1) // block
    first = tensors[0]
    device = first.get_device()  # -1 on CPU
    compute = triton.language.float64 if first.dtype == torch.float64 else triton.language.float32
    if device < 0:  # the interpreter (TRITON_INTERPRET=1), which has no libdevice
        kernel[(grid,)](*tensors, n, COMPUTE_DTYPE=compute, PRECISE=False, BLOCK_SIZE=block)
        return
    key = (
        kernel,
        first.dtype,
        device,
        block,
        n % 16 == 0,
        n == 1,
        n >= 2**31,
        *[t.data_ptr() % 16 == 0 for t in tensors],
    )
    compiled = _compiled.get(key)
    if compiled is None or device != torch.cuda.current_device() or _launch_hooks_installed():
        # The ordinary launch: compiles on first use, sets the device, runs profiler hooks.
        with torch.cuda.device(device):
            _compiled[key] = kernel[(grid,)](
                *tensors,
                n,
                COMPUTE_DTYPE=compute,
                PRECISE=True,
                BLOCK_SIZE=block,
                num_warps=num_warps,
            )
        return
    # The arguments of CompiledKernel.run as JITFunction.run passes them (triton 3.4 to 3.9).
    compiled.run(
        grid,
        1,
        1,
        torch._C._cuda_getCurrentRawStream(device),
        compiled.function,
        compiled.packed_metadata,
        None,  # launch metadata, enter hook, exit hook: only for profiler hooks, checked above
        None,
        None,
        *tensors,
        n,
        compute,
        True,
        block,
    )


def _swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not (
        a.dtype in _SUPPORTED
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.get_device() == b.get_device()  # cheaper than comparing torch.device objects
    ):
        check_inputs("swiglu_fwd", a=a, b=b)
    if not a.is_cuda and not CPU_RUNS_TRITON:
        return swiglu_reference(a, b).contiguous()
    a, b = a.contiguous(), b.contiguous()  # non-contiguous inputs cost one copy each
    out = torch.empty_like(a, memory_format=torch.contiguous_format)
    if a.numel():
        _launch(swiglu_fwd_kernel, (a, b, out), a.numel())
    return out


def _swiglu_bwd(
    grad_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not (
        a.dtype in _SUPPORTED
        and a.dtype == b.dtype == grad_out.dtype
        and a.shape == b.shape == grad_out.shape
        and a.get_device() == b.get_device() == grad_out.get_device()
    ):
        check_inputs("swiglu_bwd", a=a, b=b, grad_out=grad_out)
    if not a.is_cuda and not CPU_RUNS_TRITON:
        grad_a, grad_b = swiglu_backward_reference(grad_out, a, b)
        return grad_a.contiguous(), grad_b.contiguous()
    grad_out, a, b = grad_out.contiguous(), a.contiguous(), b.contiguous()
    grad_a = torch.empty_like(a, memory_format=torch.contiguous_format)
    grad_b = torch.empty_like(b, memory_format=torch.contiguous_format)
    if a.numel():
        _launch(swiglu_bwd_kernel, (grad_out, a, b, grad_a, grad_b), a.numel())
    return grad_a, grad_b


@torch.library.register_fake(f"{NAMESPACE}::swiglu_fwd", lib=_lib)
def _swiglu_fwd_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_inputs("swiglu_fwd", a=a, b=b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.register_fake(f"{NAMESPACE}::swiglu_bwd", lib=_lib)
def _swiglu_bwd_fake(grad_out, a, b):
    check_inputs("swiglu_bwd", a=a, b=b, grad_out=grad_out)
    empty = torch.empty_like(a, memory_format=torch.contiguous_format)
    return empty, torch.empty_like(empty)


def _direct_call_ok(*tensors: torch.Tensor) -> bool:
    """True when an impl may be called without a second trip through the dispatcher.

    That trip is a third of a small call's host cost (NOTES.md); skipping it is only safe for
    plain CUDA tensors with no tracing, tensor subclass (fake, functional) or dispatch mode
    that would want to see the op.
    """
    return (
        all(type(t) is torch.Tensor and t.is_cuda for t in tensors)
        and not torch._C._len_torch_dispatch_stack()
    )


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        if _direct_call_ok(a, b):
            return _swiglu_fwd(a, b)
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.llm_scaling_week.swiglu_fwd.default(a, b)

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        if _direct_call_ok(grad_out, a, b):
            return _swiglu_bwd(grad_out, a, b)
        return torch.ops.llm_scaling_week.swiglu_bwd.default(grad_out, a, b)


def _swiglu_fwd_autograd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # The Autograd-key kernel. `torch.library.register_autograd` would do the same job, but its
    # generic wrapper doubled the host cost of a small call on an H100 host (NOTES.md).
    if a is None or b is None:  # the schema lets None through as an undefined tensor
        check_inputs("swiglu_fwd", a=a, b=b)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _SwiGLUFunction.apply(a, b)
    if _direct_call_ok(a, b):
        return _swiglu_fwd(a, b)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.llm_scaling_week.swiglu_fwd.default(a, b)


for _device in ("CPU", "CUDA"):
    _lib.impl("swiglu_fwd", _swiglu_fwd, _device)
    _lib.impl("swiglu_bwd", _swiglu_bwd, _device)
_lib.impl("swiglu_fwd", _swiglu_fwd_autograd, "Autograd")
