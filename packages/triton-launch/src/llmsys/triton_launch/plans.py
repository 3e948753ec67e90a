"""Recorded plans: an op's eager call replayed in C++ after its first calls.

An op's impl checks its arguments, allocates its outputs and launches its kernels, and every
decision it takes follows from the arguments' signature: dtypes, sizes, strides, devices, the
low bits of the data pointers and the values of its ints, floats and bools. So for a signature
already seen, ``native_plans.cpp`` allocates the same outputs and launches the same kernels with
the new pointers, without running the impl's Python (about 8 us of host time per call on an
H100 host, DECISIONS.md). This module records what the impl did, for that file to replay.

``record(impl, args)`` runs the impl under a ``TorchDispatchMode`` that lists its allocations and
contiguous copies of its arguments and refuses anything else that reaches the dispatcher (a
fill, arithmetic, a value read back), while ``launcher`` lists its launches. The recording
becomes a plan only when everything the impl did is one of: allocate, take a view, copy an
argument to a contiguous tensor, launch a kernel that a plan can launch, return fresh
tensors (or None). ``native_plans.cpp`` records each signature twice and keeps a plan only when
both recordings agree, so anything that changes from call to call (a tuner's first runs, a
counter) leaves the signature to the impl.

Where the C++ module cannot be built (no C++ compiler, no torch headers, ``LLMSYS_NATIVE_PLANS=0``)
or the tensors are not on CUDA, ops call their impl as before (``library.PythonEntry``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import launcher

aten = torch.ops.aten
MAX_PARAMS, MAX_MAPS = 128, 8  # native_plans.cpp's limits per launch (Triton's 2 scratch included)
MAX_SHARED_BYTES = 228 * 1024  # above this Triton asks for an oversized-shared-memory launch
# Triton signature types -> a plan's parameter kinds (integers, floats; constexprs are none).
_KINDS = {"i1": "b", "i32": "i", "i64": "l", "u32": "I", "u64": "L", "fp32": "f", "f32": "f"}
_KINDS |= {"fp64": "d", "constexpr": "-"}
# What a plan may contain besides launches: allocations, and views (metadata only).
_ALLOCATIONS = frozenset(
    (
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    )
)
_VIEWS = frozenset(
    (
        aten.alias.default,
        aten.as_strided.default,
        aten.detach.default,
        aten.expand.default,
        aten.is_same_size.default,
        aten.permute.default,
        aten.select.int,
        aten.slice.Tensor,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.t.default,
        aten.transpose.int,
        aten.unbind.int,
        aten.unsqueeze.default,
        aten.view.default,
        aten._unsafe_view.default,
    )
)


class _Recording(TorchDispatchMode):
    """The impl's allocations and launches on this thread; ``refused`` names the first thing it
    did that a plan cannot replay."""

    def __init__(self, args: tuple) -> None:
        super().__init__()
        self.args = args
        self.allocations: list[torch.Tensor] = []
        self.launches: list[tuple | _Copy] = []  # launcher._launch's arguments, or a copy
        self.refused: str | None = None

    def __torch_dispatch__(
        self, func: Any, types: object, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _ALLOCATIONS:
            self.allocations.append(result)
        elif func is aten.clone.default and self._copy(args[0], kwargs, result):
            pass
        elif func not in _VIEWS and self.refused is None:
            self.refused = str(func)
        return result

    def _copy(self, source: Any, kwargs: dict, result: torch.Tensor) -> bool:
        """Record ``source.contiguous()`` of a strided argument as a step of the plan: replayed
        as ``.contiguous()`` of the same argument, which copies because the signature fixes its
        strides. (A copy of a contiguous argument, or of one passed twice, is refused: the first
        would be the argument itself at replay, the second could be either.)"""
        if kwargs.get("memory_format") is not torch.contiguous_format or source.is_contiguous():
            return False
        indices = [i for i, arg in enumerate(self.args) if arg is source]
        if len(indices) != 1:
            return False
        self.launches.append(_Copy(indices[0], result))
        return True

    def __enter__(self) -> _Recording:
        launcher.recording.active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        launcher.recording.active = None
        return super().__exit__(*exc)


def record(impl: Callable[..., Any], args: tuple) -> tuple:
    """Run ``impl(*args)`` and record it: ``(result, plan)`` (``native_plans.cpp`` describes the
    plan's layout); the plan is a string saying why where the call cannot be replayed, False
    where it is not recorded now (during a CUDA-graph capture, where a tuner does not tune)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return impl(*args), False
    with _Recording(args) as recording:
        result = impl(*args)
    try:
        return result, _plan(recording, result)
    except _NotReplayable as refusal:
        return result, str(refusal)
    except Exception as error:  # a recorder bug must not fail the call: the impl's result stands
        warnings.warn(
            f"llmsys.triton_launch: recording {getattr(impl, '__name__', impl)} failed "
            f"({type(error).__name__}: {error}); its calls run the Python impl",
            RuntimeWarning,
            stacklevel=2,
        )
        return result, f"the recorder failed ({type(error).__name__})"


class _NotReplayable(Exception):
    pass


class _Copy(NamedTuple):
    """A step of a recording: ``result`` is the contiguous copy of argument ``position``."""

    position: int
    result: torch.Tensor


def _refuse(condition: object, why: str) -> None:
    if condition:
        raise _NotReplayable(why)


def _plan(recording: _Recording, result: object) -> tuple:
    _refuse(recording.refused is not None, f"the impl called {recording.refused}")
    device = torch.cuda.current_device()
    allocations = recording.allocations
    for t in allocations:
        _refuse(
            type(t) is not torch.Tensor or t.get_device() != device or t.storage_offset(),
            "an allocation off the device or at an offset",
        )
    copies = [step for step in recording.launches if type(step) is _Copy]
    sources = [(1, i, t) for i, t in enumerate(recording.args) if type(t) is torch.Tensor]
    sources += [(2, j, t) for j, t in enumerate(allocations)]
    sources += [(3, j, copy.result) for j, copy in enumerate(copies)]
    steps = []
    for step in recording.launches:
        if type(step) is _Copy:
            steps.append((step.position,))
        elif (launch := _launch(step, sources, device)) is not None:
            steps.append(launch)
    allocated = tuple((tuple(t.shape), t.stride(), t.dtype) for t in allocations)
    return allocated, tuple(steps), _result(result, allocations)


def _launch(call: tuple, sources: list, device: int) -> tuple | None:
    """One recorded launch as plan data (None: a size-0 grid, nothing launched)."""
    kernel, grid, args, constexprs, num_warps, num_stages, options = call
    sizes = (grid,) if isinstance(grid, int) else tuple(grid)
    if 0 in sizes:
        return None
    first: Any = args[0] if args else None
    base = (
        first.base
        if launcher.TensorDescriptor and type(first) is launcher.TensorDescriptor
        else first
    )
    _refuse(
        type(base) is not torch.Tensor or base.get_device() != device, "a launch off the device"
    )
    head = (kernel, device, num_warps, num_stages, *options.items())
    compiled = launcher._compiled.get(launcher._python_key(head, args, constexprs))
    if compiled is None:
        raise _NotReplayable("a launch not in the cache of compiled kernels")
    kinds = _kinds(compiled)
    if kinds is None:
        raise _NotReplayable("a kernel that needs Triton's own launcher (scratch, clusters, ...)")
    _refuse(
        len(kinds) < len(args) or kinds[len(args) :].strip("-") != "",
        "a constexpr kernel parameter",
    )
    maps = iter(compiled.metadata.tensordesc_meta or ())
    params = []
    for value, kind in zip(args, kinds, strict=False):
        if kind == "-":
            continue
        if kind == "T":
            params += _descriptor(value, next(maps), sources)
        elif kind == "p":
            address = value.data_ptr() if isinstance(value, torch.Tensor) else value
            params.append(("p", *_source(address, sources)))
        else:
            params.append((kind, 0, 0, value))
    _refuse(
        len(params) + 2 > MAX_PARAMS or sum(p[0] == "t" for p in params) > MAX_MAPS,
        "too many parameters",
    )
    grid3 = sizes + (1,) * (3 - len(sizes))
    shared = compiled.metadata.shared
    return compiled.function, grid3, 32 * compiled.metadata.num_warps, shared, tuple(params)


def _kinds(compiled: Any) -> str | None:
    """One character per kernel argument, as a plan's parameters hold them (native_plans.cpp),
    ``T`` for a host tensor descriptor the kernel lowered to TMA and ``-`` for one that is no
    parameter (a constexpr); None when the kernel needs something only Triton's launcher does
    (scratch buffers, clusters, cooperative grids, programmatic dependent launch, oversized
    shared memory, a descriptor passed as pointers, a tuple, a 16-bit float scalar)."""
    meta = compiled.metadata
    if (
        getattr(meta, "num_ctas", 1) != 1
        or getattr(meta, "launch_cooperative_grid", False)
        or getattr(meta, "launch_pdl", False)
        or getattr(meta, "global_scratch_size", 0)
        or getattr(meta, "profile_scratch_size", 0)
        or meta.shared > MAX_SHARED_BYTES
    ):
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict):
        return None
    lowered = getattr(meta, "tensordesc_meta", None)  # one entry per descriptor, or None
    kinds = []
    for ty in signature.values():
        if lowered and isinstance(ty, str) and ty.startswith("tensordesc"):
            kinds.append("T")
        elif isinstance(ty, str) and ty.startswith("*"):
            kinds.append("p")
        elif _KINDS.get(ty) is None:
            return None
        else:
            kinds.append(_KINDS[ty])
    return "".join(kinds)


def _descriptor(descriptor: Any, meta: dict, sources: list) -> list:
    """A host tensor descriptor's parameters as Triton's launcher passes them to a kernel that
    lowered it to TMA: its tensor map (encoded at each replay), its shape (int32) and strides
    (int64). The tensor map's arguments are those of Triton's ``fill_tma_descriptor``."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    _refuse(type(descriptor) is not launcher.TensorDescriptor, "a device tensor descriptor")
    exotic = (
        meta.get("fp4_padded")
        or meta.get("is_im2col")
        or getattr(descriptor, "round_f32_to_tf32", False)
    )
    _refuse(exotic, "an fp4, im2col or tf32-rounding tensor descriptor")
    shape, strides, size = list(descriptor.shape), list(descriptor.strides), meta["elem_size"]
    _refuse(strides[-1] != 1, "a tensor descriptor with an inner stride")
    byte_strides = tuple(size * s for s in reversed(strides[:-1]))
    spec = (
        TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
        meta["swizzle"],
        1
        if descriptor.padding == "nan"
        else 0,  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
        tuple(reversed(shape)),
        byte_strides,
        tuple(reversed(meta["block_size"])),
    )
    address = descriptor.base.data_ptr()
    return [
        ("t", *_source(address, sources), spec),
        *(("i", 0, 0, n) for n in shape),
        *(("l", 0, 0, s) for s in strides),
    ]


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s data pointer to the end of its last element."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.itemsize


def _source(address: int, sources: list) -> tuple[int, int, int]:
    """(source, index, byte offset) of the one argument or allocation that ``address`` points
    into; refused when none or several do."""
    _refuse(type(address) is not int, "a pointer that is not an int")
    exact = [(kind, i) for kind, i, t in sources if t.data_ptr() == address]
    if exact:
        _refuse(len(exact) != 1, "a pointer into two arguments")
        return (*exact[0], 0)
    inside = [
        (k, i, address - t.data_ptr())
        for k, i, t in sources
        if 0 <= address - t.data_ptr() < _span(t)
    ]
    _refuse(len(inside) != 1, "a pointer into no argument or allocation, or several")
    return inside[0]


def _output(t: Any, allocations: list[torch.Tensor]) -> tuple | None:
    if t is None:
        return None
    _refuse(type(t) is not torch.Tensor, "a result that is not a tensor")
    for j, a in enumerate(allocations):
        if t is a:
            return (j,)
        if t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and a.numel():
            return j, tuple(t.shape), t.stride(), t.storage_offset()
    raise _NotReplayable("a result that is an argument or a tensor from elsewhere")


def _result(result: object, allocations: list[torch.Tensor]) -> tuple:
    if result is None:
        return 0, ()
    if type(result) is tuple:
        return 2, tuple(_output(t, allocations) for t in result)
    output = _output(result, allocations)
    _refuse(output is None, "None as the only result")
    return 1, (output,)
