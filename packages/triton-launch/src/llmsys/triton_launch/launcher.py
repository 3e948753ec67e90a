"""A lean launch: after the first call of a specialization, call the compiled kernel directly.

``kernel[grid](*args)`` (``JITFunction.run``) binds every argument, recomputes the
specialization key and looks the kernel up on every call: about 10 us of host time on an H100
host, as much as a small kernel's GPU time. Here the key is computed from what Triton
specializes on (a pointer's dtype and 16-byte alignment; an integer's equality to 1,
divisibility by 16 and width; a tensor descriptor's dtype and block shape) and the compiled
kernel is launched through Triton's ``CompiledKernel.run``, whose arguments have been the same
from triton 3.4 to 3.9. The launch enqueues on the current stream and never synchronizes, so it
can be captured in a CUDA graph. (An op's replayed calls launch in C++, past all of this:
plans.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import triton

if TYPE_CHECKING:
    from .plans import _Recording as _PlanRecording

try:  # host-side tensor descriptors for the copy engine (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

# specialization key (_python_key) -> compiled kernel (a Triton CompiledKernel; Triton has no types)
_compiled: dict[tuple, Any] = {}


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (grid sizes). ``triton.cdiv`` gives the same on the host
    but goes through Triton's constexpr-function wrapper: about 4 us a call (DECISIONS.md), paid
    several times per op."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two at or above ``n`` (1 for ``n <= 1``); ``triton.next_power_of_2``
    on the host without its wrapper's cost."""
    return 1 << max(n - 1, 0).bit_length()


_sm_counts: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``, asked once per device: the size of a
    persistent grid."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def runs_under_interpreter(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it runs CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def kernel_path(kernel: object, device: torch.device | str) -> str:
    """Which path an op built on ``kernel`` takes for tensors on ``device``, in words, the way
    every llmsys kernel package picks it: ``"Triton kernel"`` on CUDA, ``"Triton kernel under
    TRITON_INTERPRET=1"`` on CPU when ``kernel`` was decorated under the interpreter, else
    ``"eager fallback"`` (the package's plain-PyTorch code)."""
    if torch.device(device).type == "cuda":
        return "Triton kernel"
    if runs_under_interpreter(kernel):
        return "Triton kernel under TRITON_INTERPRET=1"
    return "eager fallback"


def _key(value: Any) -> object:
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) is int:
        return value == 1, value % 16 == 0, -(2**31) <= value < 2**31
    if type(value) is float:  # floats are never specialized: one entry for every value
        return float
    if TensorDescriptor is not None and type(value) is TensorDescriptor:
        return TensorDescriptor, value.base.dtype, tuple(value.block_shape)
    return type(value), value


def _python_key(head: tuple, args: tuple, constexprs: dict) -> tuple:
    """The specialization key of a launch: ``head`` (kernel, device, num_warps, num_stages, the
    options' items), one entry per argument, the constexpr values."""
    return (*head, *[_key(a) for a in args], *constexprs.values())


def _check_order(kernel: Any, args: tuple, constexprs: dict) -> None:
    """The cached path passes constexprs by position: their order must be the signature's."""
    expected = list(kernel.arg_names[len(args) :])
    if list(constexprs) != expected:
        raise ValueError(
            f"launch: `constexprs` must name {kernel.__name__}'s arguments after the "
            f"{len(args)} in `args`, in signature order {expected}, got {list(constexprs)}"
        )


def _checked_grid(grid: object) -> tuple[int, ...] | None:
    """``grid`` as a tuple of 1 to 3 positive ints; None when a size is 0; else ``TypeError`` or
    ``ValueError`` naming it."""
    sizes = (grid,) if isinstance(grid, int) else grid
    if not isinstance(sizes, tuple | list) or not all(
        isinstance(g, int) and not isinstance(g, bool) for g in sizes
    ):
        raise TypeError(f"launch: `grid` must be an int or a tuple of 1 to 3 ints, got {grid!r}")
    if not 1 <= len(sizes) <= 3 or min(sizes) < 0:
        raise ValueError(
            f"launch: `grid` must be 1 to 3 sizes, each at least 0, got {tuple(sizes)}"
        )
    return None if 0 in sizes else tuple(sizes)


_runtime_knobs = triton.knobs.runtime
# torch.cuda.current_device without its lazy-init check (a compiled kernel means CUDA is
# initialized), and the current stream as an int; None in a CPU-only build of torch, where no
# launch reaches them.
_current_device = cast(Callable[[], int], getattr(torch._C, "_cuda_getDevice", None))
_current_stream = cast(Callable[[int], int], getattr(torch._C, "_cuda_getCurrentRawStream", None))


def _launch_hooks_installed() -> bool:
    hook = _runtime_knobs.launch_enter_hook  # a HookChain: never None, empty by default
    return bool(getattr(hook, "calls", hook))


def launch(
    kernel: Any,
    grid: int | tuple[int, ...],
    args: tuple,
    constexprs: dict,
    num_warps: int = 4,
    num_stages: int | None = None,
    **options: object,
) -> None:
    """Run ``kernel[grid](*args, **constexprs, num_warps=.., num_stages=.., **options)``, fast
    after the first call of each specialization.

    Args:
        kernel: a ``@triton.jit`` function.
        grid: the number of programs of a 1-D grid, or a tuple of up to three sizes; a size of 0
            launches nothing; a negative size or a non-int is an error.
        args: the kernel's runtime arguments in signature order; the first must be a tensor or a
            host tensor descriptor (its device is the launch device).
        constexprs: the ``tl.constexpr`` arguments that follow them, in signature order.
        num_warps: warps per program.
        num_stages: software-pipelining stages of the kernel's loops; None: Triton's default.
        options: other compile options of ``kernel[grid]`` (``enable_fp_fusion=False``, ...).

    CPU tensors (under ``TRITON_INTERPRET=1``), a device other than the current one, and
    installed Triton launch hooks (profilers) take the ordinary launch.
    """
    _launch(kernel, grid, args, constexprs, num_warps, num_stages, options)


class _Recording(threading.local):
    active: _PlanRecording | None = None  # while an impl is recorded on this thread


recording = _Recording()


def _launch(
    kernel: Any,
    grid: int | tuple[int, ...],
    args: tuple,
    constexprs: dict,
    num_warps: int,
    num_stages: int | None,
    options: dict,
) -> None:
    """``launch`` with its compile options as one dict (never modified here)."""
    if recording.active is not None:
        recording.active.launches.append(
            (kernel, grid, args, constexprs, num_warps, num_stages, options)
        )
    sizes = _checked_grid(grid)
    if sizes is None:  # a size of 0: nothing to launch
        return
    grid_x, grid_y, grid_z = sizes + (1,) * (3 - len(sizes))
    if type(args) is not tuple:
        args = tuple(args)
    first = args[0]
    device = (first if isinstance(first, torch.Tensor) else first.base).get_device()
    if device < 0:  # CPU tensors: the interpreter (TRITON_INTERPRET=1)
        _check_order(kernel, args, constexprs)
        kernel[(grid_x, grid_y, grid_z)](*args, **constexprs)
        return
    fast = device == _current_device() and not _launch_hooks_installed()
    key = _python_key((kernel, device, num_warps, num_stages, *options.items()), args, constexprs)
    compiled = _compiled.get(key)
    if compiled is None or not fast:
        # The ordinary launch: compiles on first use, sets the device, runs profiler hooks.
        _check_order(kernel, args, constexprs)
        options = {**options, "num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        with torch.cuda.device(device):
            compiled = kernel[(grid_x, grid_y, grid_z)](*args, **constexprs, **options)
        if not runs_under_interpreter(kernel):
            _compiled[key] = compiled
        return
    compiled.run(
        grid_x,
        grid_y,
        grid_z,
        _current_stream(device),
        compiled.function,
        compiled.packed_metadata,
        None,  # launch metadata, enter hook, exit hook: only for profiler hooks, checked above
        None,
        None,
        *args,
        *constexprs.values(),
    )
