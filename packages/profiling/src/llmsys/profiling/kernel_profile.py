"""Where a train step's time goes: the kernels of each profiler range, and the GPU's idle time.

Each case (one model variant, size, context and precision; default small at context 256 on
cuda, tiny at 64 on cpu; bf16) runs ``--warmup`` train steps, then ``--steps`` steps three times
over:
1. profiler off, each step timed with the wall clock: the ``step`` / ``wall`` row, ms per step.
   Every phase ends with a synchronize, so this is the whole step as the host sees it.
2. only with ``--nvtx`` (on by itself under Nsight Systems, which sets
   NSYS_PROFILING_SESSION_ID), CUDA only: inside ``torch.autograd.profiler.emit_nvtx()``, so the
   ops and the ranges below become NVTX ranges on the nsys timeline. Nothing is measured here.
3. under ``torch.profiler``: the Chrome trace ``trace.json`` (``trace-<n>.json`` for the n-th of
   several cases; open it at https://ui.perfetto.dev) and the kernel summary.

Kernel summary: for each range -- ``forward``, ``backward``, ``optimizer_step`` (set by the step)
and, with ``--attention naive`` only, ``attention/scores``, ``attention/softmax`` and
``attention/weighted_sum`` -- the ``--top`` kernels by total time. A kernel belongs to a range
when the CPU op that launched it (the profiler links the two by correlation id) started inside
the range, on any thread: on CUDA the backward's ops run on autograd's own thread. Nested ranges
count in both (``attention/scores`` is inside ``forward``); the attention ranges hold forward
ops only, their gradients run in ``backward``. On CPU there are no kernels, and the ops stand in
for them: each op's self CPU time (without its children's, so nothing counts twice).

Rows: kernel = the kernel (or op) name (see ``short_name``); provider = the range; x = the case
and the variant; p20 / p50 / p80 and mean = ms per call; config = calls per step, ms per step and
share of the range's kernel time. On CUDA, per phase (``forward``, ``backward``,
``optimizer_step``) a ``wall`` row (the phase as the e2e benchmark measures it, profiler off) and
a ``gpu`` row (its kernels' time; config: the host share, the part of the phase the GPU waited).
Two ``step`` rows per case: ``wall`` (above) and ``gpu``, the
kernel time per step, whose config gives the GPU's idle fraction, 1 - kernel time / wall time:
the time it waits for the host (Python, launches, the synchronizes). The model runs on one
stream; kernels that overlapped on several would make the sum overstate the busy time. On CPU
the row is ``cpu-ops``, the ops' time per step as a fraction of the wall time (the ops were timed
under the profiler, which slows them, so this is no idle fraction).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
import os
import re
import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int

from .e2e import Runner
from .options import (
    Variant,
    add_model_arguments,
    fill_device_defaults,
    variants,
)
from .progress import progress
from .training import unless_out_of_memory

HELP = (
    "torch.profiler over train steps: kernels per range (forward, backward, optimizer, attention)"
)
RANGES = (
    "forward",
    "backward",
    "optimizer_step",
    "attention/scores",
    "attention/softmax",
    "attention/weighted_sum",
)
PHASES = RANGES[:3]  # a step is these three, one after the other
NAME_WIDTH = 80


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, contexts=(256,), cpu_contexts=(64,))
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=5,
        help="untimed steps first (CUDA-graph modes record their graphs in the first three)",
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="steps timed and profiled")
    parser.add_argument("--top", type=positive_int, default=10, help="kernels listed per range")
    parser.add_argument(
        "--nvtx", action="store_true", help="also run the steps under emit_nvtx (see above)"
    )


def attribute(
    events: Iterable[Any], device_kernels: bool, ranges: Collection[str] = RANGES
) -> dict[str, dict[str, list[float]]]:
    """range name -> {kernel or op name -> microseconds of each call} from profiler events
    (``prof.events()``). ``device_kernels``: the kernels each CPU op launched (its ``kernels``,
    linked by the profiler); else each CPU op's self time, ranges and annotations left out."""
    windows: defaultdict[str, list[tuple[float, float]]] = defaultdict(
        list
    )  # range name -> sorted (start, end) of each time it ran
    for event in events:
        if event.name in ranges and event.device_type == DeviceType.CPU:
            windows[event.name].append((event.time_range.start, event.time_range.end))
    for spans in windows.values():
        spans.sort()
    found: dict[str, dict[str, list[float]]] = {
        name: defaultdict(list) for name in ranges if name in windows
    }
    for event in events:
        if event.device_type != DeviceType.CPU:
            continue  # device-side copies of the events; their kernels hang off the CPU ops
        if device_kernels:
            calls = [(kernel.name, kernel.duration) for kernel in event.kernels]
        elif event.is_user_annotation or event.name in ranges:
            continue  # a range's self time is the Python between its ops, not an op
        else:
            calls = [(event.name, event.self_cpu_time_total)]
        start = event.time_range.start
        for name, spans in windows.items():
            i = bisect.bisect_right(spans, (start, math.inf)) - 1
            if i >= 0 and start < spans[i][1]:
                for kernel, us in calls:
                    found[name][kernel].append(us)
    return found


def _percentiles(values: list[float], scale: float = 1.0) -> dict[str, Any]:
    """p20 / p50 / p80 of ``values`` times ``scale``, as Row fields."""
    p20, p50, p80 = results.quantiles(values)
    return {"p20": p20 * scale, "p50": p50 * scale, "p80": p80 * scale}


def short_name(name: str, kernel: bool) -> str:
    """A name for tables, at most 80 characters. A CUDA kernel's loses "void", its namespaces
    and its argument lists, and keeps its template arguments: in
    ``elementwise_kernel<128, 4, gpu_kernel_impl_nocast<direct_copy_kernel_cuda::...``
    they tell which elementwise kernel it is. An op's name (``aten::mm``) stays as it is."""
    if kernel:
        name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
        name = re.sub(r"\b\w+::(?=[\w~])", "", name)  # at::native::copy -> copy
        while (shorter := re.sub(r"\([^()]*\)", "", name)) != name:  # f(g(x), int) -> f
            name = shorter
        name = name.strip()
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def profile_case(
    runner: Runner, warmup: int, steps: int, nvtx: bool, trace: Path
) -> dict[str, Any]:
    """Wall ms of each step (profiler off), then the profiled steps' attribution."""
    on_cuda = torch.device(runner.device).type == "cuda"
    for _ in range(warmup):
        runner.step()
    phases = [runner.step() for _ in range(steps)]  # ms per phase, each ending in a synchronize
    wall = [sum(step.values()) for step in phases]
    if nvtx and on_cuda:
        with torch.autograd.profiler.emit_nvtx():
            for _ in range(steps):
                runner.step()
    elif nvtx:
        print("profile: NVTX ranges need CUDA; --nvtx skipped")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.step()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    found = attribute(prof.events(), device_kernels=on_cuda)
    return {"wall": wall, "phases": phases, "found": found}


def phase_rows(
    found: dict[str, dict[str, list[float]]],
    phases: list[dict[str, float]],
    steps: int,
    common: dict[str, Any],
    on_cuda: bool,
) -> list[results.Row]:
    """Per phase, the measured wall time next to its kernels' time: where they differ by more
    than a few percent, the difference is host time the GPU waited for."""
    if not on_cuda:
        return []
    rows = []
    for phase, range_name in zip(("forward", "backward", "optimizer"), PHASES, strict=True):
        measured = [p[phase] for p in phases if phase in p]
        kernels_ms = sum(map(sum, found.get(range_name, {}).values())) / 1e3 / steps
        wall_ms = statistics.mean(measured)
        host = 1 - kernels_ms / wall_ms
        print(f"  {range_name}: measured {wall_ms:.3f} ms, kernels {kernels_ms:.3f} ms: "
              f"{host:.0%} of it is host time")  # fmt: skip
        rows += [
            results.Row(range_name, "wall", **common, **_percentiles(measured), mean=wall_ms,
                        config="profiler off; ends with a synchronize"),
            results.Row(range_name, "gpu", **common, p20=math.nan, p50=kernels_ms, p80=math.nan,
                        mean=kernels_ms, config=f"GPU kernels; host share {host:.0%}"),
        ]  # fmt: skip
    return rows


def case_rows(
    found: dict[str, dict[str, list[float]]],
    wall: list[float],
    steps: int,
    common: dict[str, Any],
    on_cuda: bool,
    top: int,
) -> list[results.Row]:
    """The two ``step`` rows, then the ``top`` kernels of each range; prints the summary."""
    unit = "GPU kernels" if on_cuda else "CPU ops (self time)"
    kernels_ms = sum(sum(map(sum, found.get(p, {}).values())) for p in PHASES) / 1e3 / steps
    wall_ms = statistics.mean(wall)
    if on_cuda:
        busy = f"GPU idle {1 - kernels_ms / wall_ms:.0%} of the wall time"
    else:
        busy = f"{kernels_ms / wall_ms:.0%} of the wall time (ops timed under the profiler)"
    print(f"  wall {wall_ms:.3f} ms/step (profiler off), {unit} {kernels_ms:.3f} ms/step: {busy}")
    std = statistics.stdev(wall) if len(wall) > 1 else 0.0
    busy_ms: dict[str, Any] = dict(p20=math.nan, p50=kernels_ms, p80=math.nan, mean=kernels_ms)
    rows = [
        results.Row("step", "wall", **common, **_percentiles(wall), mean=wall_ms, std=std,
                    config="profiler off; each phase ends with a synchronize"),
        results.Row("step", "gpu" if on_cuda else "cpu-ops", **common, **busy_ms,
                    config=f"{unit} per step; {busy}"),
    ]  # fmt: skip
    for name, per_full_name in found.items():
        per_kernel: defaultdict[str, list[float]] = defaultdict(
            list
        )  # kernels whose short names agree count as one
        for kernel, us in per_full_name.items():
            per_kernel[short_name(kernel, on_cuda)] += us
        total = sum(map(sum, per_kernel.values()))
        print(f"  {name}: {total / 1e3 / steps:.3f} ms/step of {unit}")
        print(f"    {'time %':>7} {'ms/step':>9} {'calls/step':>10} {'mean us':>9}  name")
        ranked = sorted(per_kernel.items(), key=lambda item: sum(item[1]), reverse=True)
        for kernel, us in ranked[:top]:
            share = sum(us) / total if total else 0.0
            per_step, calls, mean_us = sum(us) / 1e3 / steps, len(us) / steps, statistics.mean(us)
            print(f"    {share:7.1%} {per_step:9.3f} {calls:10g} {mean_us:9.1f}  {kernel}")
            ms = _percentiles(us, 1e-3)
            config = f"calls/step={calls:g}; ms/step={per_step:.4g}; share={share:.1%}"
            rows.append(
                results.Row(kernel, name, **common, **ms, mean=mean_us / 1e3, config=config)
            )
    return rows


def run(args: argparse.Namespace) -> list[results.Row]:
    fill_device_defaults(args)
    cases = [
        (size, context, dtype, variant)
        for size, context, dtype in itertools.product(args.size, args.context_length, args.dtype)
        for variant in variants(args, dtype)
    ]
    nvtx = args.nvtx or "NSYS_PROFILING_SESSION_ID" in os.environ
    on_cuda = torch.device(args.device).type == "cuda"
    gpu, stamp = results.device_name(args.device), results.timestamp()

    def label(case: tuple) -> str:
        size, context, dtype, variant = case
        return f"{size} ctx={context} batch={args.batch_size} {dtype} {variant.label}"

    rows = []
    for n, case in enumerate(progress(cases, "profile", label), 1):
        size, context, dtype, variant = case
        trace = args.out / ("trace.json" if len(cases) == 1 else f"trace-{n}.json")
        x = f"{size} ctx={context} batch={args.batch_size} {variant.label}"  # provider: range
        common: dict[str, Any] = dict(mode="profile", x=x, dtype=dtype, gpu=gpu, timestamp=stamp)
        print(f"profile: {label(case)}: {args.steps} steps after {args.warmup} warm-up")

        def profiled(
            variant: Variant = variant,
            size: str = size,
            context: int = context,
            trace: Path = trace,
        ) -> dict[str, Any]:
            runner = Runner(variant, size, context, args.batch_size, "train-step", args.device)
            return profile_case(runner, args.warmup, args.steps, nvtx, trace)

        measured = unless_out_of_memory(profiled, args.device)
        if measured is None:
            rows.append(results.Row(kernel="step", provider="wall", p20=math.nan, p50=math.nan,
                                    p80=math.nan, config="OOM", **common))  # fmt: skip
            continue
        found = measured["found"]
        rows += case_rows(found, measured["wall"], args.steps, common, on_cuda, args.top)
        rows += phase_rows(found, measured["phases"], args.steps, common, on_cuda)
        print(f"  wrote {trace}")
    return rows
