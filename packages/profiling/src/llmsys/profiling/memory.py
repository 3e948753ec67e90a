"""Peak memory of the Transformer LM: an inference forward and a full train step.

Sweeps sizes x context lengths (default small at 128 256 512 on cuda, tiny at 32 64 on cpu) x
precision (default fp32 and bf16 autocast) x activation checkpointing. Checkpointing runs both
ways by default; ``--checkpoint`` or ``--no-checkpoint`` keeps one. ``forward`` runs under
``torch.no_grad()``, where checkpointing changes nothing, so it is measured once per case,
without it.

Each case builds a fresh model, runs one warm-up step (which also allocates the optimizer state),
then measures one step:
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (all tensors the
  caching allocator hands out: weights, optimizer state, activations, temporaries, workspaces).
- CPU: there is no allocator peak, so the step runs once more under
  ``torch.profiler.profile(profile_memory=True)``; peak = the bytes of the tensors alive when
  the step starts (parameters, buffers, optimizer state, the batch) + the highest running sum of
  the profiler's allocation (+) and free (-) events during the step.
``p50`` is the time of one step with no profiler or history recording on (one sample).

One train-step case (``--snapshot N``: the N-th train-step case of the sweep, default the first;
0: none) is looked at closely. On CUDA, one more step runs with the allocator's history recorded:
``memory_snapshot.pickle`` (open it at https://pytorch.org/memory_viz), ``memory.png`` (named
after ``memory.csv``, so ``llmsys-bench report`` shows it beside the table: bytes in use after
each allocation event, counting bytes requested, a few percent under the allocator's peak, which
counts whole blocks) and the ``--top`` largest allocations of the step with where
they were made: the line of Python outside torch, or for the backward's, the autograd node. On
CPU, only the timeline, drawn from the profiler's events (they carry no stacks).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import pickle
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int

from .e2e import Runner
from .options import (
    add_model_arguments,
    fill_device_defaults,
    variants,
)
from .progress import progress
from .training import unless_out_of_memory

HELP = "peak memory of forward and train step over context length, precision and checkpointing"
MODES = ("forward", "train-step")
TORCH_DIR = os.path.dirname(torch.__file__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, contexts=(128, 256, 512), cpu_contexts=(32, 64))
    # None = both ways; --checkpoint / --no-checkpoint keep one.
    parser.set_defaults(dtype=["fp32", "bf16"], checkpoint=None)
    parser.add_argument(
        "--mode", nargs="+", default=list(MODES), choices=MODES, help="forward and/or train-step"
    )
    parser.add_argument(
        "--snapshot",
        type=non_negative_int,
        default=1,
        metavar="N",
        help="look closely at the N-th train-step case (0: none)",
    )
    parser.add_argument("--top", type=positive_int, default=10, help="largest allocations to list")


# ---- the snapshot and timeline, as pure functions of data ------------------------------------


def running_total(deltas: Iterable[int], start: int = 0) -> list[int]:
    """Bytes in use at the start and after each allocation (+) or free (-)."""
    return list(itertools.accumulate(deltas, initial=start))


def trace_deltas(snapshot: dict, device: int = 0) -> list[int]:
    """Byte changes of ``device``'s allocator trace: +size per alloc, -size per free_completed
    (the block is reusable from then on; free_requested only marks it for a later free)."""
    sign = {"alloc": 1, "free_completed": -1}
    return [
        sign[event["action"]] * event["size"]
        for event in snapshot["device_traces"][device]
        if event["action"] in sign
    ]


def requested_at_trace_start(snapshot: dict, device: int = 0) -> int:
    """Bytes already in use when the trace began: what is in use when the snapshot was taken,
    less what the trace added since (tensors from before, such as the weights and the optimizer
    state, are in the segments but have no alloc event). Counted as the trace counts: bytes
    requested, before the allocator rounds them up to its blocks."""
    in_use = sum(
        seg.get("requested_size", seg["allocated_size"])
        for seg in snapshot["segments"]
        if seg.get("device", 0) == device
    )
    return in_use - sum(trace_deltas(snapshot, device))


def allocation_site(frames: list[dict], skip: tuple[str, ...] = (TORCH_DIR,)) -> str:
    """Where an allocation was made: the innermost Python frame outside torch (frames come
    innermost first), as "file:line function". The backward's ops run on autograd's C++ thread,
    with no Python frame: for them, the autograd node that ran ("backward MmBackward0")."""
    for frame in frames:
        name = frame["filename"]
        if name.endswith(".py") and not name.startswith(skip):
            return f"{name}:{frame['line']} {frame['name']}"
    for frame in frames:
        node = re.search(r"(\w+Backward\w*)::apply", frame["name"])
        if node:
            return f"backward {node.group(1)}"
    return "(no frame outside torch)"


def largest_allocations(snapshot: dict, device: int = 0, top: int = 10) -> list[tuple[int, str]]:
    """The ``top`` largest allocations of the trace: (bytes, allocation site), largest first."""
    allocs = [e for e in snapshot["device_traces"][device] if e["action"] == "alloc"]
    allocs.sort(key=lambda e: e["size"], reverse=True)
    return [(e["size"], allocation_site(e.get("frames", []))) for e in allocs[:top]]


def plot_timeline(totals: list[int], path: Path, title: str) -> Path | None:
    """Active memory (GiB) over the allocation events, peak marked; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("memory: matplotlib is not installed; no timeline plot")
        return None
    gib = [t / 2**30 for t in totals]
    peak = max(range(len(gib)), key=gib.__getitem__)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(gib, lw=1)
    ax.annotate(f"peak {gib[peak]:.3g} GiB", (peak, gib[peak]), ha="center", va="bottom")
    ax.set(xlabel="allocation event", ylabel="allocated GiB", title=title)
    ax.set_ylim(0, gib[peak] * 1.1 or 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- measuring ------------------------------------------------------------------------------


def resident_bytes(runner: Runner) -> int:
    """Bytes of the tensors a step starts with: parameters, buffers, optimizer state, batch
    (each storage once: tokens and targets are views of one tensor)."""
    tensors = [*runner.model.parameters(), *runner.model.buffers(), runner.tokens, runner.targets]
    tensors += [p.grad for p in runner.model.parameters() if p.grad is not None]
    if runner.optimizer is not None:
        for state in runner.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def profiled_deltas(step: Callable[[], object]) -> list[int]:
    """Run ``step()`` under the profiler with memory events on; the byte change of each CPU
    allocation (+) and free (-), in order. The parsed ``prof.events()`` folds these into the ops
    they happened in, so they are read from the raw Kineto events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]


def measure(runner: Runner) -> dict:
    """One warm-up step, then the peak bytes and time of one step (see the module doc)."""
    runner.step()
    if torch.device(runner.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(runner.device)
        step_ms = sum(runner.step().values())  # ms per phase, each ending in a synchronize
        return {"ms": step_ms, "peak": torch.cuda.max_memory_allocated(runner.device)}
    step_ms = sum(runner.step().values())
    totals = running_total(profiled_deltas(runner.step), start=resident_bytes(runner))
    return {"ms": step_ms, "peak": max(totals), "totals": totals}


def look_closely(runner: Runner, measured: dict, out: Path, title: str, top: int) -> None:
    """The snapshot, the timeline plot and the largest allocations of one train step."""
    out.mkdir(parents=True, exist_ok=True)
    if torch.device(runner.device).type != "cuda":
        print("memory: the allocator snapshot and its largest allocations need CUDA; on CPU")
        print("        only the timeline, from the profiler's memory events")
        plot_timeline(measured["totals"], out / "memory.png", title)
        return
    index = torch.device(runner.device).index
    device = torch.cuda.current_device() if index is None else index
    # stacks="all": C++ frames too, which name the autograd node of a backward allocation;
    # context="alloc": no stacks for frees (half the file, and the viewer needs none).
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="all")
    try:
        runner.step()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    path = out / "memory_snapshot.pickle"
    with path.open("wb") as f:
        pickle.dump(snapshot, f)
    totals = running_total(
        trace_deltas(snapshot, device), requested_at_trace_start(snapshot, device)
    )
    plot_timeline(totals, out / "memory.png", title)
    requested, blocks = max(totals) / 2**30, measured["peak"] / 2**30
    print(f"memory: {title}: wrote {path} (open it at https://pytorch.org/memory_viz)")
    print(f"        timeline peak {requested:.3f} GiB requested ({blocks:.3f} GiB in whole blocks)")
    print(f"        the {top} largest allocations of the step:")
    for size, site in largest_allocations(snapshot, device, top):
        print(f"        {size / 2**20:10.1f} MiB  {site}")


def run(args: argparse.Namespace) -> list[results.Row]:
    fill_device_defaults(args)
    if any(variant.cuda_graphs for variant in variants(args, args.dtype[0])):
        raise SystemExit(
            "memory: CUDA graphs (--compile-mode reduce-overhead, the llmsys preset) allocate "
            "from a private pool that the allocator's peak does not count; measure memory "
            "without them (e.g. --preset llmsys --compile-mode default)"
        )
    checkpoints = [False, True] if args.checkpoint is None else [args.checkpoint]
    cases = []  # (size, context, dtype, mode, variant)
    for size, context, dtype in itertools.product(args.size, args.context_length, args.dtype):
        for variant in variants(args, dtype):
            if "forward" in args.mode:  # no_grad: checkpointing does nothing
                plain = dataclasses.replace(variant, checkpoint=False)
                cases.append((size, context, dtype, "forward", plain))
            if "train-step" in args.mode:
                for checkpoint in checkpoints:
                    trained = dataclasses.replace(variant, checkpoint=checkpoint)
                    cases.append((size, context, dtype, "train-step", trained))
    train_cases = [case for case in cases if case[3] == "train-step"]
    closely = train_cases[args.snapshot - 1] if 0 < args.snapshot <= len(train_cases) else None

    def label(case: tuple) -> str:
        size, context, dtype, mode, variant = case
        return f"{size} ctx={context} {dtype} {mode} {variant.label}"

    rows: list[results.Row] = []
    gpu, stamp = results.device_name(args.device), results.timestamp()
    method = (
        "torch.cuda.max_memory_allocated"
        if torch.device(args.device).type == "cuda"
        else "tensors at step start + peak of profiler memory events"
    )
    for case in progress(cases, "memory", label):
        size, context, dtype, mode, variant = case

        def measured_case(case: tuple = case) -> dict[str, Any]:
            size, context, _, mode, variant = case
            runner = Runner(variant, size, context, args.batch_size, mode, args.device)
            measured = measure(runner)
            if case is closely:
                look_closely(runner, measured, args.out, label(case), args.top)
            return measured

        measured = unless_out_of_memory(measured_case, args.device)
        nan = float("nan")
        rows.append(
            results.Row(
                kernel="transformer_lm/memory",
                provider=variant.label,
                mode=mode,
                x=f"{size} ctx={context} batch={args.batch_size}",
                dtype=dtype,
                p20=nan,
                p50=measured["ms"] if measured else nan,
                p80=nan,
                config=f"peak of one step after one warm-up: {method}" if measured else "OOM",
                gpu=gpu,
                timestamp=stamp,
                memory_gib=measured["peak"] / 2**30 if measured else None,
            )
        )
    return rows
