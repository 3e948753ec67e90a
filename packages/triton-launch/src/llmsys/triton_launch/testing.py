"""Test helpers for the kernel packages: assert that ops replay their recorded plans, and capture
a call in a CUDA graph and replay it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .library import _impls, native_module

CALLS_TO_RECORD = 3  # a signature's first call, then two recordings (native_plans.cpp)


def assert_replays(call: Callable[[], object], *ops: torch._ops.OpOverload) -> None:
    """Call ``call()`` until its ops have recorded plans, then once more, and assert that every
    call of each op in ``ops`` replayed (with no ``ops``: every ``define_op(replays=True)`` op
    that the last ``call()`` reached, at least one). CUDA only; the AssertionError names the op
    and why its last call that did not replay did not."""
    if not torch.cuda.is_available():
        raise AssertionError("assert_replays: replay is CUDA only, and there is no CUDA device")
    if native_module() is None:
        raise AssertionError("assert_replays: recorded plans are unavailable (warned why)")
    for _ in range(CALLS_TO_RECORD):
        call()
    before = {op: _report(op) for op in _impls}
    call()
    reached = {op: (_report(op)[0] - before[op][0]) for op in _impls}
    if not ops:
        ops = tuple(op for op, n in reached.items() if n and _impls[op].replays)
        if not ops:
            raise AssertionError("assert_replays: `call` reached no op made with replays=True")
    for op in ops:
        if op not in _impls:
            raise ValueError(f"assert_replays: `ops` must be ops made by define_op, got {op}")
        _, replayed, why_not = _report(op)
        if reached[op] == 0:
            raise AssertionError(f"{op}: `call` did not call it (with CUDA tensors)")
        missed = reached[op] - (replayed - before[op][1])
        if missed:
            raise AssertionError(f"{op}: {missed} of {reached[op]} calls not replayed: {why_not}")


def _report(op: torch._ops.OpOverload) -> tuple[int, int, str]:
    """(calls, replayed calls, why the last call that was not replayed was not) of ``op``'s
    native entry; no calls for an entry that never met a CUDA tensor."""
    entry = _impls[op]
    if not hasattr(entry, "report"):
        return 0, 0, "no call with a CUDA tensor"
    report = entry.report()
    return report["calls"], report["replayed"], report["why_not"]


def replay_in_cuda_graph(fn: Callable[..., Any], inputs: Sequence, fresh: Sequence) -> Any:
    """Capture ``fn(*inputs)`` in a CUDA graph, copy ``fresh`` into the tensor ``inputs``, replay.

    ``fn`` runs once first on a side stream (compiling and tuning kernels, as
    ``torch.cuda.graph`` requires). The capture fails if ``fn`` synchronizes with the host.
    Returns the captured call's outputs after the replay: they were computed from ``fresh``.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)
    for static, value in zip(inputs, fresh, strict=True):
        if isinstance(static, torch.Tensor):
            static.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    return outputs
