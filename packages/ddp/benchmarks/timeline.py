"""Where a data-parallel training step's time goes: host, GPU compute, NCCL and their overlap.

    torchrun --nproc-per-node 2 timeline.py --out DIR                     # xl, batch 4 per GPU
    torchrun --nproc-per-node 2 timeline.py --batch-size 12 --ddp "no communication" \\
        "torch DDP" --fsdp --out DIR

For each strategy (the names of ``strategies.py`` after ``--ddp``, of ``fsdp.py`` after
``--fsdp``), on the model and batch those scripts use: the median step (barrier to the slowest
rank's end), the host time to issue one step without waiting for the GPU, and from one step under
``torch.profiler`` (CPU and CUDA):

- ``compute_busy_ms``: the union of the GPU intervals of every kernel that is not NCCL's;
- ``nccl_busy_ms``: the union of NCCL kernels' intervals (a kernel waiting for the other rank
  counts: it holds its SMs);
- ``overlap_ms``: the time both ran at once; ``gpu_idle_ms``: the time neither ran;
- ``host_issue_ms``: from the step's first CPU op to its last (under the profiler, which slows
  the host; compare it with ``host_nosync_ms``, measured without).

A step whose host time is close to its wall time while ``gpu_idle_ms`` is large is host-bound:
the GPU waits for the Python that launches its kernels and collectives. Rank 0 writes
``DIR/timeline-b<batch>.json``, the top CPU ops of each strategy to ``DIR/top-*.txt``, and both
summed up in ``DIR/timeline-b<batch>.csv``: one row per strategy, with the host's CPU time per
``c10d::allreduce_`` call from its top-ops table.

``--summarize JSON`` writes that CSV to stdout from a JSON written earlier (with its
``top-*.txt`` beside it), without measuring: no GPU and no torchrun.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

import llmsys.bench_harness as harness
from llmsys.bench_harness.arguments import non_negative_int, positive_int
from llmsys.ddp import init_distributed, local_device
from llmsys.profiling import training
from llmsys.profiling.config import SIZES, ModelConfig
from llmsys.profiling.model import TransformerLM

_strategies = harness.load_beside(__file__, "strategies")
_fsdp = harness.load_beside(__file__, "fsdp")


def merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """Sorted, non-overlapping intervals covering the same time as ``intervals``."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def covered(intervals: list[list[float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[list[float]], b: list[list[float]]) -> float:
    """Time covered by both of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(trace: dict) -> dict:
    """Milliseconds of compute, NCCL, overlap and idle in a Chrome trace of one step."""
    events = trace["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    cpu = [e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
    nccl_kernels = [e for e in kernels if "nccl" in e["name"].lower()]
    nccl = merged([(e["ts"], e["ts"] + e["dur"]) for e in nccl_kernels])
    compute = merged(
        [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    )
    begin = min(e["ts"] for e in cpu + kernels)
    end = max(e["ts"] + e["dur"] for e in cpu + kernels)
    return {
        "span_ms": (end - begin) / 1e3,
        "host_issue_ms": (max(e["ts"] + e["dur"] for e in cpu) - begin) / 1e3,
        "compute_busy_ms": covered(compute) / 1e3,
        "nccl_busy_ms": covered(nccl) / 1e3,
        "overlap_ms": intersection(compute, nccl) / 1e3,
        "gpu_idle_ms": (end - begin - covered(merged(compute + nccl))) / 1e3,
        "kernels": len(kernels),
        "nccl_kernels": len(nccl_kernels),
    }


def profiler_row(table: str, name: str) -> dict[str, str]:
    """The row of op ``name`` in a ``key_averages().table()``, by column header ({} if absent)."""
    header: list[str] = []
    for line in table.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == "Name":
            header = cells
        elif header and cells[0] == name:
            return dict(zip(header, cells, strict=True))
    return {}


def _us(text: str) -> float:
    """Microseconds of a profiler table's time ("166.835us", "1.000ms", "2.5s")."""
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(number) * {"us": 1.0, "ms": 1e3, "s": 1e6}[unit]


def summary_rows(summary: dict, tops: dict[str, str]) -> list[dict]:
    """One row per strategy of a ``timeline-b<batch>.json`` summary: its times and kernel
    counts, and from its top-ops table (``tops``, by strategy) the calls of
    ``c10d::allreduce_`` and the host's CPU time per call."""
    rows = []
    for key, parts in summary["strategies"].items():
        kind, name = key.split(": ", 1)
        allreduce = profiler_row(tops.get(key, ""), "c10d::allreduce_")
        rows.append({
            "gpu": summary["gpu"], "case": summary["case"],
            "norm_rope": summary.get("kernels", ""), "world_size": summary["world_size"],
            "kind": kind, "strategy": name, **parts,
            "allreduce_calls": allreduce.get("# of Calls", ""),
            "allreduce_cpu_us": _us(allreduce["CPU time avg"]) if allreduce else "",
            "torch": summary["torch"], "timestamp": summary["timestamp"],
        })  # fmt: skip
    return rows


def _slug(key: str) -> str:
    return key.replace(": ", "-").replace(" ", "_")


def write_summary(summary_json: Path, out: TextIO) -> None:
    """The CSV of :func:`summary_rows` for a timeline JSON and the top-ops tables beside it."""
    summary = json.loads(summary_json.read_text())
    batch = summary_json.stem.removeprefix("timeline-")
    tops = {}
    for key in summary["strategies"]:
        top = summary_json.with_name(f"top-{_slug(key)}-{batch}.txt")
        if top.exists():
            tops[key] = top.read_text()
    rows = summary_rows(summary, tops)
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)


def build(kind: str, name: str, config: ModelConfig, device, world_size: int):
    """(model, a step function over a batch) for a strategy of strategies.py or fsdp.py."""
    if kind == "fsdp":
        model, optimizer = _fsdp.build(name, config, device, world_size)
        autocast = _fsdp.STRATEGIES[name].autocast
        return model, optimizer, lambda t, y: _fsdp.train_step(model, optimizer, t, y, autocast)
    torch.manual_seed(0)
    model = TransformerLM(config, device=device)
    wrap = _strategies.STRATEGIES[name]
    if wrap is not None and world_size > 1:
        model = wrap(model)
    optimizer = training.make_optimizer(model, "adamw-fused")
    return model, optimizer, lambda t, y: _strategies.train_step(model, optimizer, t, y, "bf16")


def profile_step(step, device) -> tuple[dict, str]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        step()
        training.synchronize(device)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch, "trace.json")
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return breakdown(trace), table


def measure(kind: str, name: str, args, config, device, rank: int, world_size: int) -> dict:
    model, optimizer, train = build(kind, name, config, device, world_size)
    torch.manual_seed(1 + rank)
    tokens, targets = training.random_batch(config, args.batch_size, args.context_length, device)

    def step():
        train(tokens, targets)

    times, peak = _strategies.timed_steps(step, args.warmup, args.steps, device, world_size)

    def together() -> None:  # every rank starts the next step at once
        if world_size > 1:
            dist.barrier()

    host = []
    for _ in range(3):
        together()
        training.synchronize(device)
        started = time.perf_counter()
        step()
        host.append((time.perf_counter() - started) * 1e3)
        training.synchronize(device)
    together()
    parts, table = profile_step(step, device)
    _strategies.release(model, optimizer)
    del model, optimizer
    training.free_device_memory(device)
    return {
        "step_ms": statistics.median(_strategies.slowest(t, device) * 1e3 for t in times),
        "host_nosync_ms": statistics.median(host),
        "peak_gib": peak,
        **parts,
        "top": table,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", default="xl", choices=list(SIZES), help="a profiling model size (default xl)"
    )
    parser.add_argument("--context-length", type=positive_int, default=512, help="(default 512)")
    parser.add_argument(
        "--batch-size", type=positive_int, default=4, help="sequences per rank (default 4)"
    )
    parser.add_argument("--steps", type=positive_int, default=6, help="timed steps (default 6)")
    parser.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed steps first (default 3)"
    )
    parser.add_argument("--ddp", nargs="*", choices=list(_strategies.STRATEGIES),
                        default=["no communication", "torch DDP", "bucketed 25 MB",
                                 "bucketed 100 MB bf16"],
                        help="strategies of strategies.py")  # fmt: skip
    parser.add_argument("--fsdp", nargs="*", choices=list(_fsdp.STRATEGIES),
                        default=["FSDP bf16", "torch FSDP2 bf16"],
                        help="strategies of fsdp.py")  # fmt: skip
    parser.add_argument("--kernels", choices=("eager", "fused"), default="eager",
                        help="RMSNorm and RoPE: eager, or llmsys.kernels_fused")  # fmt: skip
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="folder rank 0 writes into")
    where.add_argument(
        "--summarize", type=Path, metavar="JSON", help="an earlier run's JSON: its CSV to stdout"
    )
    args = parser.parse_args(argv)
    if args.summarize:
        write_summary(args.summarize, sys.stdout)
        return
    rank, world_size = init_distributed()
    device = local_device()
    config = _fsdp.model_config(args.size, args.context_length, args.kernels)
    found = {}
    for kind, names in (("ddp", args.ddp), ("fsdp", args.fsdp)):
        for name in names:
            found[f"{kind}: {name}"] = measure(kind, name, args, config, device, rank, world_size)
            if rank == 0:
                shown = {k: round(v, 1) for k, v in found[f"{kind}: {name}"].items()
                         if isinstance(v, float)}  # fmt: skip
                print(f"{kind}: {name}: {shown}", flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        for key, m in found.items():
            (args.out / f"top-{_slug(key)}-b{args.batch_size}.txt").write_text(m.pop("top"))
        summary = {
            "gpu": harness.device_name(device), "torch": torch.__version__,
            "case": f"{args.size} ctx{args.context_length} b{args.batch_size}/rank",
            "kernels": args.kernels,
            "world_size": world_size, "timestamp": harness.timestamp(), "strategies": found,
        }  # fmt: skip
        path = args.out / f"timeline-b{args.batch_size}.json"
        path.write_text(json.dumps(summary, indent=1) + "\n")
        with path.with_suffix(".csv").open("w", newline="") as out:
            write_summary(path, out)
        print(f"wrote {path} and {path.with_suffix('.csv')}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
