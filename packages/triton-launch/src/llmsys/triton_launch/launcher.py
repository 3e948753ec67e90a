"""A lean launch: after the first call of a specialization, call the compiled kernel directly.

``kernel[grid](*args)`` (``JITFunction.run``) binds every argument, recomputes the
specialization key and looks the kernel up on every call: about 10 us of host time on an H100
host, as much as a small kernel's GPU time. Here the key is computed from what Triton
specializes on (a pointer's dtype and 16-byte alignment; an integer's equality to 1,
divisibility by 16 and width) and the compiled kernel is called through
``CompiledKernel.run``, whose arguments have been the same from triton 3.4 to 3.9.
"""

from __future__ import annotations

import torch

_compiled: dict[tuple, object] = {}


def runs_under_interpreter(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it runs CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def _key(value) -> object:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) is int:
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    return type(value), value


def _launch_hooks_installed() -> bool:
    import triton

    hook = triton.knobs.runtime.launch_enter_hook  # a HookChain: never None, empty by default
    return bool(getattr(hook, "calls", hook))


def launch(kernel, grid: int, args: tuple, constexprs: dict, num_warps: int = 4) -> None:
    """Run ``kernel[(grid,)](*args, **constexprs, num_warps=num_warps)``, fast after the first.

    Args:
        kernel: a ``@triton.jit`` function.
        grid: the number of programs of a 1-D grid; 0 launches nothing.
        args: the kernel's runtime arguments in signature order; the first must be a tensor
            (its device is the launch device).
        constexprs: the ``tl.constexpr`` arguments that follow them, in signature order.
        num_warps: warps per program.

    CPU tensors (under ``TRITON_INTERPRET=1``), a device other than the current one, and
    installed Triton launch hooks (profilers) take the ordinary launch.
    """
    if grid == 0:
        return
    device = args[0].get_device()  # -1 on CPU
    if device < 0:  # CPU tensors: the interpreter (TRITON_INTERPRET=1)
        kernel[(grid,)](*args, **constexprs)
        return
    # Tensors are inlined rather than sent through _key: a function call per argument is a
    # measurable part of a 15 us call.
    key = (
        kernel,
        device,
        num_warps,
        *[
            (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else _key(a)
            for a in args
        ],
        *constexprs.values(),
    )
    compiled = _compiled.get(key)
    if compiled is None or device != torch.cuda.current_device() or _launch_hooks_installed():
        # The ordinary launch: compiles on first use, sets the device, runs profiler hooks.
        with torch.cuda.device(device):
            compiled = kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
        if not runs_under_interpreter(kernel):
            _compiled[key] = compiled
        return
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
        *args,
        *constexprs.values(),
    )
