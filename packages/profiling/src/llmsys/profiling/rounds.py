"""Training strategies measured side by side on every rank of a process group: timed steps, the
slowest rank's numbers, and rounds in which the strategies take turns.

A step is as slow as its slowest rank, so every time and peak is the maximum over the ranks.
Strategies take turns in rounds (each round builds and measures every strategy once) so that a
host whose speed drifts over minutes moves them all alike and their ratios hold. Used by
``llmsys-bench train`` and the ddp package's ``benchmarks/strategies.py`` and ``fsdp.py``.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from llmsys.bench_harness import results

from .training import synchronize


def slowest(value: float, device: torch.device | str) -> float:
    """The largest ``value`` over the ranks (``value`` itself outside a process group)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def nccl_kernel_ms(step: Callable[[], object], device: torch.device) -> float | None:
    """GPU time of NCCL kernels in one profiled call of ``step`` (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    return sum(e.device_time_total for e in events if "nccl" in e.name.lower()) / 1e3


def timed_steps(
    step: Callable[[], object], warmup: int, steps: int, device: torch.device, world_size: int
) -> tuple[list[float], float | None]:
    """Seconds of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones, every rank
    starting each together, and the peak GiB allocated while they ran (None off CUDA)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        if world_size > 1:
            dist.barrier()  # every rank starts the step together: less noise between runs
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None
    return times, peak


def combine(
    runs: list[dict[str, Any]], medians: Sequence[str] = ("nccl_ms", "host_ms")
) -> dict[str, Any]:
    """One strategy's measurements over several rounds: every step's ``times_ms``, the largest
    ``peak_gib``, the median of each key of ``medians`` over the rounds that have it, and the
    first round's value of every other key."""
    combined = {**runs[0], "times_ms": [t for r in runs for t in r["times_ms"]]}
    for key in medians:
        values = [r[key] for r in runs if r.get(key) is not None]
        combined[key] = statistics.median(values) if values else None
    peaks = [r["peak_gib"] for r in runs if r.get("peak_gib") is not None]
    combined["peak_gib"] = max(peaks) if peaks else None
    return combined


def interleaved(
    measure_one: Callable[[str, bool], dict[str, Any]],
    names: list[str],
    rounds: int,
    report: Callable[[str, dict[str, Any]], None],
    medians: Sequence[str] = ("nccl_ms", "host_ms"),
) -> dict[str, dict[str, Any]]:
    """Measure every strategy in ``rounds`` rounds, each round all strategies one after another
    (``measure_one(name, first_round)``; the caller profiles in the first round only), reporting
    each measurement as it comes; returns each strategy's :func:`combine`-d measurements."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names:
            gc.collect()
            runs[name].append(measure_one(name, round_index == 0))
            report(name, runs[name][-1])
    return {name: combine(measured, medians) for name, measured in runs.items()}


def release(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Free the weights, gradients, optimizer state and buckets now. torch DDP's C++ reducer and
    the parameters' hooks reference each other, a cycle the garbage collector cannot see, so
    deleting the model leaves its memory allocated; emptying the tensors frees it anyway."""
    optimizer.state.clear()
    for bucket in getattr(model, "buckets", []):
        bucket.buffer = bucket.reduced = None
    for param in model.parameters():
        param.grad = None
        param.data = torch.empty(0, device=param.device)


def run_fields(measured: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The fields of a strategy's row that say where and when it ran and how its steps spread
    (no mean or spread for a strategy without times: NaN, out of memory or refused)."""
    times = [t for t in measured["times_ms"] if math.isfinite(t)]
    return dict(
        gpu=results.device_name(device),
        version=torch.__version__,
        timestamp=results.timestamp(),
        mean=statistics.fmean(times) if times else None,
        std=statistics.pstdev(times) if times else None,
        memory_gib=measured["peak_gib"],
    )
