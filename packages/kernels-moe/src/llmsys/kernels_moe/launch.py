"""A lean Triton launch: after the first call of a specialization, call the compiled kernel.

``JITFunction.run`` binds and re-specializes every argument on every call; for the small cases
(a few microseconds of GPU work) that host cost, not the GPU, sets the time of the permute's
default path, whose launch after the host sync is on the critical path (benchmarks/NOTES.md).
"""

from __future__ import annotations

import torch
import triton

_compiled: dict[tuple, object] = {}


def _specialization(value) -> object:
    # What Triton specializes a runtime argument on: a pointer's dtype and 16-byte alignment; an
    # integer's equality to 1, divisibility by 16 and width.
    if type(value) is int:
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    return type(value), value


def _hooks_installed() -> bool:
    hook = triton.knobs.runtime.launch_enter_hook  # a HookChain: never None, empty by default
    return bool(getattr(hook, "calls", hook))


def launch(kernel, grid: int, args: tuple, constexprs: dict, num_warps: int = 4) -> None:
    """Run ``kernel`` on a 1-D grid; ``args`` are its runtime arguments, then ``constexprs``."""
    if grid == 0:
        return
    device = args[0].get_device()  # -1 on CPU
    if device < 0 or type(kernel).__name__ == "InterpretedFunction":  # TRITON_INTERPRET=1
        kernel[(grid,)](*args, **constexprs)
        return
    key = (kernel, device, num_warps, *map(_specialization, args), *constexprs.values())
    compiled = _compiled.get(key)
    if compiled is None or device != torch.cuda.current_device() or _hooks_installed():
        # The ordinary launch: compiles on first use, sets the device, runs profiler hooks.
        with torch.cuda.device(device):
            _compiled[key] = kernel[(grid,)](*args, **constexprs, num_warps=num_warps)
        return
    # CompiledKernel.run's arguments as JITFunction.run passes them (triton 3.4 to 3.9).
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
