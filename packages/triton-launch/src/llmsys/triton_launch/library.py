"""Registering a package's ops and calling them: one way for every kernel package.

Each op is defined on a ``torch.library.Library`` fragment with one Python implementation (for
CPU, and for CUDA until the op's C++ entry takes over) and a fake (meta) implementation, so
``torch.compile(fullgraph=True)`` keeps it as one node and CUDA graphs capture its launches.
Every package calls its ops the same way: the public function takes the package's
``autograd.Function`` when grad is wanted (``wants_grad``), else ``call_below_autograd(op,
...)``; an op called by its registered name is differentiable (or refuses gradients) through
torch's own ``torch.library.register_autograd``.

In eager mode on plain tensors the dispatcher's trip to a Python kernel costs several
microseconds of host time (more than the launch, DECISIONS.md). So the package's own calls (its
public functions and its ``autograd.Function``\\ s) go to the implementation directly whenever
that is all the dispatcher would do, and through the op otherwise: under ``torch.compile``,
dispatch and function modes (fake tensors), functorch transforms, ``torch.jit.trace``, the
profiler (which then shows the op by name), and for tensor subclasses or devices other than CPU
and CUDA (``_plain_call``).

Each op's calls go through its entry (``_impls``): a ``PythonEntry`` (the impl), or after the
op's first CUDA call a ``native_plans.Plans`` that replays a recorded plan of the impl where it
has one (plans.py records it). That entry is then also the op's CUDA kernel, registered in C++,
so a call by name that the dispatcher hands to CUDA replays without a trip into Python.
``forget`` and ``disabled`` are the switches a test or a benchmark needs around it.

Why not ``torch.library.custom_op`` or ``triton_op``: each adds a layer of Python around every
eager call; measured in DECISIONS.md.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType
from typing import Any

import torch

from . import launcher, native, plans

# The Python kernel's keys. CUDA calls reach it through CompositeExplicitAutograd (every backend)
# until the op's C++ entry is registered for CUDA itself, which the dispatcher then prefers:
# registering over a Python CUDA kernel would warn, and removing that kernel could free it in
# the middle of the call that triggers the swap.
KERNEL_KEYS = ("CPU", "CompositeExplicitAutograd")

# op -> its entry: a PythonEntry, or a native_plans.Plans after its first CUDA call
_impls: dict[torch._ops.OpOverload, Any] = {}
# Arguments other than tensors that cannot intercept a call (an FX Proxy, say, would).
_PLAIN_TYPES = frozenset((int, float, bool, type(None)))
_AUTOGRAD = torch._C.DispatchKey.AutogradFunctionality


def define_op(
    lib: torch.library.Library,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    replays: bool = False,
) -> torch._ops.OpOverload:
    """Define ``lib.ns::schema``, implement it with ``impl`` on CPU and CUDA, and register
    ``fake`` for tracing; returns the op's default overload.

    ``replays``: the op is expected to replay a recorded plan at a typical shape (its impl only
    checks, allocates, views, copies an argument to a contiguous tensor and launches);
    ``testing.assert_replays`` holds it to that. An impl that reads anything besides its
    arguments that may change while a process runs (a module switch a benchmark swaps) needs
    ``forget(op)`` from whoever changes it: a plan replays what the impl did when recorded."""
    name = schema.split("(", 1)[0]
    lib.define(schema)
    op = getattr(getattr(torch.ops, lib.ns), name).default

    # The dispatcher hands a Python kernel its arguments without the trailing ones left at their
    # defaults, and the native kernel all of them: the impl gets them all, so that a call by
    # name has one signature either way (else the first call, which makes the native entry,
    # would not count toward its plan).
    defaults = tuple(argument.default_value for argument in op._schema.arguments)

    # the op's entry: its impl, replayed from a recorded plan where it can be
    def kernel(*args: Any) -> Any:
        return _impls[op](*args, *defaults[len(args) :])

    for key in KERNEL_KEYS:
        lib.impl(name, kernel, key)
    torch.library.register_fake(f"{lib.ns}::{name}", fake, lib=lib)
    _impls[op] = PythonEntry(impl, op, replays)
    return op


class PythonEntry:
    """An op's impl called from Python: ``entry(*args)`` is ``impl(*args)``;
    ``entry.below_autograd(args)`` is ``call_below_autograd``'s choice between the impl and the
    op. ``native_plans.Plans`` has the same two calls, with replay; an entry becomes one at its
    first call with a CUDA tensor, where the C++ module can be had."""

    __slots__ = ("impl", "op", "replays", "upgradable")

    def __init__(
        self, impl: Callable[..., Any], op: torch._ops.OpOverload, replays: bool = False
    ) -> None:
        self.impl, self.op, self.replays, self.upgradable = impl, op, replays, True

    def __call__(self, *args: Any) -> Any:
        if self.upgradable and (upgraded := self._upgraded(args)) is not None:
            return upgraded(*args)
        return self.impl(*args)

    def below_autograd(self, args: tuple) -> Any:
        if self.upgradable and (upgraded := self._upgraded(args)) is not None:
            return upgraded.below_autograd(args)
        if _plain_call(args) is False:
            return self.impl(*args)
        return self.op(*args)

    def _upgraded(self, args: tuple) -> Any:
        """The native entry that replaces this one, at the first call with a CUDA tensor; None
        where the C++ module cannot be had. It becomes the op's CUDA kernel, and where the op has
        a ``register_autograd`` formula, a C++ kernel in front of torch's autograd kernel for
        CUDA sends calls that autograd does not record straight to it."""
        if not any(type(a) is torch.Tensor and a.is_cuda for a in args):
            return None
        self.upgradable = False
        module = native_module()
        if module is None:
            return None
        entry = module.Plans(self.impl, self.op, self.replays)
        name = self.op._schema.name
        entry.register_kernel(name, "CUDA")
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"):
            module.register_autograd(name, "AutogradCUDA")
        _impls[self.op] = entry
        return entry


@cache
def native_module() -> ModuleType | None:
    """The compiled ``native_plans`` module, initialized, or None (with one warning saying why)."""
    if os.environ.get("LLMSYS_NATIVE_PLANS", "1") == "0":
        return None
    try:
        module = native.load(native.build())
        module.init(plans.record, launcher._runtime_knobs)
        return module
    except Exception as error:  # no C++ compiler, no headers, no driver: the impls still work
        warnings.warn(
            f"llmsys.triton_launch: recorded plans are unavailable ({error}); ops run their "
            "Python impl on every call (about 8 us more per call)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def forget(*ops: torch._ops.OpOverload) -> None:
    """Forget the recorded plans of ``ops`` (every op when none is named): their next calls
    record again. Call it right after changing what an impl reads besides its arguments (a
    module switch, a patched helper, a tuner's cache), and again after restoring it.

    Raises:
        ValueError: an op was not made by ``define_op``.
    """
    for op in ops or tuple(_impls):
        entry = _impls.get(op)
        if entry is None:
            raise ValueError(f"forget: `ops` must be ops made by define_op, got {op}")
        if type(entry) is not PythonEntry:
            entry.clear()


@contextmanager
def disabled() -> Iterator[None]:
    """Within this block every op runs its Python impl (nothing is replayed or recorded); for
    tests that watch what an impl allocates, such as the poisoned-allocation fixture."""
    module = native_module() if torch.cuda.is_available() else None  # (CPU calls never replay)
    before = module.set_enabled(False) if module else None
    try:
        yield
    finally:
        if module:
            module.set_enabled(before)


# The thread-state tests of _plain_call, bound once: an attribute chain per test per call was
# a third of its cost.
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_layers = torch._C._functorch.peek_interpreter_stack
_tracing_state = torch._C._get_tracing_state
_profiling = torch._C._autograd._profiler_enabled
_Tensor, _strided = torch.Tensor, torch.strided


def _plain_call(args: tuple) -> bool | None:
    """False when the impl may be called directly with ``args``: the dispatcher, past autograd,
    would do nothing but call it and autograd records nothing. True: a tensor requires grad and
    autograd records. None: anything else (the op): tracing, a mode, a transform, a thread-local
    profiler, or an argument other than a strided CPU or CUDA tensor of the Tensor class itself,
    an int, a float, a bool or None. (``native_plans.plain`` is the same test in C++, for the
    calls a native entry takes.)

    Observers that hook into the dispatcher globally rather than per thread (a standalone
    ``ExecutionTraceObserver``) do not see the calls this lets past it; ``set_default_device``
    (a function mode) sends every call through the op."""
    if (
        _is_compiling()  # first: dynamo folds it and skips the rest
        or _dispatch_modes()
        or _function_mode()
        or _functorch_layers() is not None
        or _tracing_state() is not None
        or _profiling()
    ):
        return None
    requires_grad = _plain_arguments(args)
    return requires_grad and _autograd_records()


def _plain_arguments(args: tuple) -> bool | None:
    """None unless every tensor argument is a strided tensor of the Tensor class itself on CPU
    or CUDA and every other argument an int, float, bool or None; else whether a tensor
    requires grad. (A loop rather than a generator: this runs on every call.)"""
    requires_grad = False
    for arg in args:
        if type(arg) is _Tensor:
            if not ((arg.is_cuda or arg.is_cpu) and arg.layout is _strided):
                return None
            requires_grad = requires_grad or arg.requires_grad
        elif type(arg) not in _PLAIN_TYPES:  # a subclass, a proxy, anything else: the op
            return None
    return requires_grad


def wants_grad(*args: object) -> bool:
    """Whether autograd would record a call with these arguments: a tensor argument requiring
    grad, grad mode on, and autograd not switched off for this thread
    (``_AutoDispatchBelowAutograd``, as inside ``custom_op``'s no-grad path). A public function
    takes its ``autograd.Function`` when this is true, else ``call_below_autograd``.

    The tensors are asked first: inference calls stop there (the thread-state test is a
    pybind call, about 1 us on an H100 host, DECISIONS.md)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.requires_grad:
            return _autograd_records()
    return False


def _autograd_records() -> bool:
    """Grad mode on, and autograd not switched off for this thread."""
    if not torch.is_grad_enabled():
        return False
    # (dynamo cannot trace the dispatch-key test; a compiled graph is never below autograd)
    return torch.compiler.is_compiling() or not torch._C._dispatch_tls_is_dispatch_key_excluded(
        _AUTOGRAD
    )


def refuse_double_backward(name: str) -> None:
    """Call first in an ``autograd.Function``'s backward whose kernels have no backward of their
    own: a backward run with ``create_graph=True`` (grad mode on inside it) raises instead of
    returning gradients without their graph, which would drop second-order terms silently.

    Raises:
        RuntimeError: grad mode is on (the backward runs with ``create_graph=True``).
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: double backward is not supported (backward ran with create_graph=True)"
        )


def call_below_autograd(op: torch._ops.OpOverload, *args: Any) -> Any:
    """Call ``op`` where autograd has nothing to record: from an ``autograd.Function``'s forward
    or backward, or where no argument requires grad. Its impl directly when that is all the
    dispatcher would do and autograd records nothing (``_plain_call``), else the op. A backward
    run with ``create_graph=True`` (grad mode on, saved inputs requiring grad) goes through the
    op, so its autograd sees the call as it would without this shortcut.

    Raises:
        ValueError: ``op`` was not made by ``define_op``.
    """
    entry = _impls.get(op)
    if entry is None:
        raise ValueError(f"call_below_autograd: `op` must be an op made by define_op, got {op}")
    if _is_compiling():  # (asked in Python: dynamo folds it and traces the op)
        return op(*args)
    return entry.below_autograd(args)
