"""ZeRO-1 memory and step time: plain AdamW, ShardedOptimizer(AdamW) and torch's
ZeroRedundancyOptimizer(AdamW), one after another in one run, on the profiling package's
Transformer LM with DDP.

    torchrun --nproc-per-node 2 packages/sharded-optim/benchmarks/memory_and_step.py --out DIR
    torchrun --nproc-per-node 2 packages/sharded-optim/benchmarks/memory_and_step.py \\
        --size tiny --context-length 64 --batch-size 2 --steps 3 --warmup 1 --out /tmp/zero1

The default on CUDA is the XL model (1.998B parameters; float32 weights, bf16 autocast), context
512, batch 4 per rank, AdamW (lr 1e-4, betas (0.9, 0.95), weight decay 0.1; fused on CUDA) and
one rank per GPU over NCCL. Without CUDA it runs on the CPU over gloo, by default the tiny model at
context 64, as a smoke test (its numbers say nothing). Rank 0 prints a line as each variant
builds its model, warms up and times its steps. All variants synchronize gradients with torch's
DistributedDataParallel (``gradient_as_bucket_view=True``, so the gradients are DDP's buckets and
not a second copy), so only the optimizer differs.

For each variant, on each rank:

- peak memory (``torch.cuda.max_memory_allocated``, reset before each phase) of three phases:
  ``model`` (building the model and DDP, whose gradient buckets are allocated then and show as
  "rest"), ``fwd-bwd`` (forward and backward of a step after the warm-up, up to just before
  ``step()``) and ``step`` (``optimizer.step()`` alone); each split into parameters, gradients,
  optimizer state (summed from the tensors on this rank) and the rest (activations, temporaries,
  DDP buckets, allocator rounding);
- the median wall time of a training step (forward, backward, ``step()``; CUDA-synchronized)
  over ``--steps`` steps after ``--warmup`` warm-up steps, and of ``step()`` alone;
- the accounting: AdamW keeps 2 float32 tensors per parameter and a step counter, so the
  predicted optimizer state is 8 bytes per element (+ 4 per tensor) of the parameters a rank
  holds state for (all of them for plain AdamW; the owned share for both sharded variants, which
  partition a single param group with the same sorted greedy rule); the predicted peak saving of a
  sharded variant is plain AdamW's predicted state minus its own.

Rank 0 writes ``DIR/<gpu>.csv`` (the shared schema; memory and saving rows carry ``memory_gib``,
the saving rows' ``roofline_fraction`` is measured / predicted saving), ``DIR/<gpu>.png`` and
prints a Markdown table and the targets (printed and recorded, never asserted): the largest
per-rank optimizer state at most 1.05 x (total / N) + the largest parameter's state; the
measured peak saving within 5% of the predicted one; a training step at most 1.1x
ZeroRedundancyOptimizer's.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int
from llmsys.profiling.config import SIZES, ModelConfig
from llmsys.profiling.model import TransformerLM
from llmsys.profiling.training import autocast, lm_loss, random_batch
from llmsys.sharded_optim import ShardedOptimizer, assign_owners

VARIANTS = ("adamw", "sharded", "zero-redundancy")  # the last is the baseline for time
PHASES = ("model", "fwd-bwd", "step")
PARTS = ("params", "grads", "optimizer-state", "rest")
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
STATE_TENSORS = 2  # AdamW: exp_avg and exp_avg_sq, each the parameter's shape and dtype
STEP_COUNTER_BYTES = 4  # AdamW's per-parameter step: a 0-dim float32 tensor
GIB = 2**30
RESULTS = Path(__file__).parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),  # the first paragraph, whole
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="folder for <gpu>.csv and .png (each run overwrites them)",
    )
    parser.add_argument(
        "--size",
        default=argparse.SUPPRESS,  # filled by fill_device_defaults; no "(default: None)"
        choices=list(SIZES),
        help="model size (default: xl on CUDA, tiny on the CPU, a smoke run)",
    )
    parser.add_argument(
        "--context-length",
        default=argparse.SUPPRESS,
        type=positive_int,
        help="tokens per sequence (default: 512 on CUDA, 64 on the CPU)",
    )
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument(
        "--dtype",
        default="bf16",
        choices=("bf16", "fp32"),
        help="autocast dtype over float32 weights",
    )
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per variant")
    parser.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed steps per variant first"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=VARIANTS,
        help="optimizers to measure, in this order",
    )
    parser.add_argument(
        "--one-gpu",
        action="store_true",
        help="every rank on cuda:0, talking over gloo: the memory of N ranks on a host with one "
        "GPU (its step times then measure gloo through host memory, not NCCL)",
    )
    return parser.parse_args(argv)


def fill_device_defaults(args: argparse.Namespace, on_cuda: bool) -> argparse.Namespace:
    """The model size and context the user left out: the XL model at 512 on CUDA, the tiny one
    at 64 on the CPU (the XL model takes minutes and 8 GB per rank to build there)."""
    if getattr(args, "size", None) is None:
        args.size = "xl" if on_cuda else "tiny"
    if getattr(args, "context_length", None) is None:
        args.context_length = 512 if on_cuda else 64
    return args


def say(message: str) -> None:
    """A progress line, from rank 0 only."""
    if dist.get_rank() == 0:
        print(message, flush=True)


# ---- one variant ----------------------------------------------------------------------------


def make_optimizer(variant: str, params, device: torch.device) -> torch.optim.Optimizer:
    options = {**ADAMW, "fused": device.type == "cuda"}
    if variant == "adamw":
        return torch.optim.AdamW(params, **options)
    if variant == "sharded":
        return ShardedOptimizer(params, torch.optim.AdamW, **options)
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **options)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The per-parameter state this rank holds (ZeroRedundancyOptimizer keeps it inside)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim.state
    return optimizer.state


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def breakdown(model, optimizer, device: torch.device, peak: int | None) -> dict:
    """Peak bytes of a phase, split into parameters, gradients, optimizer state and the rest."""
    params = list(model.parameters())
    state = [
        value
        for values in optimizer_state(optimizer).values()
        for value in values.values()
        if isinstance(value, torch.Tensor) and value.device == device
    ]
    parts = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer-state": tensor_bytes(state),
    }
    parts["rest"] = None if peak is None else peak - sum(parts.values())
    return {"peak": peak, **parts}


def peak_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None  # the CPU has no allocator peak: only the tensors are counted
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(variant: str, args, device: torch.device) -> dict:
    """Build, warm up, measure the memory of one step and time ``args.steps`` more."""
    free_memory(device)
    left_over = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    reset_peak(device)
    config = ModelConfig.named(args.size, context_length=args.context_length)
    say(f"{variant}: building the {args.size} model (context {args.context_length}) on {device}")
    model = TransformerLM(config, device=device)  # float32 weights
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    optimizer = make_optimizer(variant, ddp.parameters(), device)
    memory = {"model": breakdown(model, optimizer, device, peak_bytes(device))}
    tokens, targets = random_batch(config, args.batch_size, args.context_length, device)

    def forward_backward() -> None:
        with autocast(args.dtype, device):
            logits = ddp(tokens)  # (B, T, vocab)
        lm_loss(logits, targets).backward()

    say(f"{variant}: {args.warmup} warm-up step(s), then one step measuring memory")
    for _ in range(args.warmup):  # the first step also allocates the optimizer state
        forward_backward()
        optimizer.step()
        optimizer.zero_grad()
    reset_peak(device)
    forward_backward()
    memory["fwd-bwd"] = breakdown(model, optimizer, device, peak_bytes(device))
    reset_peak(device)
    optimizer.step()
    memory["step"] = breakdown(model, optimizer, device, peak_bytes(device))
    optimizer.zero_grad()

    say(f"{variant}: timing {args.steps} step(s)")
    train_ms, step_ms = [], []
    for _ in range(args.steps):
        synchronize(device)
        start = time.perf_counter()
        forward_backward()
        synchronize(device)
        backward_done = time.perf_counter()
        optimizer.step()
        synchronize(device)
        end = time.perf_counter()
        optimizer.zero_grad()
        train_ms.append((end - start) * 1e3)
        step_ms.append((end - backward_done) * 1e3)
    # The model, DDP and the optimizer are freed when this returns (the next measure() starts
    # by collecting what cycles keep alive).
    return {
        "memory": memory,
        "train_ms": train_ms,
        "step_ms": step_ms,
        "left_over": left_over,
        "numels": [p.numel() for p in model.parameters()],
    }


# ---- the accounting -------------------------------------------------------------------------


def predicted_state_bytes(numels: list[int], itemsize: int, world_size: int) -> dict:
    """Predicted AdamW state per rank: everything for plain AdamW, the ownership's share for the
    sharded variants (ZeroRedundancyOptimizer uses the same sorted greedy rule on one group)."""

    def state(indices) -> int:
        return sum(STATE_TENSORS * numels[i] * itemsize + STEP_COUNTER_BYTES for i in indices)

    ownership = assign_owners(numels, world_size)
    shares = [state(ownership.params_of(rank)) for rank in range(world_size)]
    everything = state(range(len(numels)))
    return {
        "adamw": [everything] * world_size,
        "sharded": shares,
        "zero-redundancy": shares,
        "owned_elements": list(ownership.loads),
        "largest_param_state": STATE_TENSORS * max(numels) * itemsize + STEP_COUNTER_BYTES,
    }


# ---- rows, targets, table and plot (rank 0) ---------------------------------------------------


def step_peak(memory: dict) -> int | None:
    """The peak of a whole training step: the larger of its two phases."""
    peaks = [memory[phase]["peak"] for phase in ("fwd-bwd", "step")]
    return None if None in peaks else max(peaks)


def slowest(per_rank: list[dict], key: str) -> list[float]:
    """The samples (``"train_ms"`` or ``"step_ms"``) of the rank with the largest median."""
    return max((m[key] for m in per_rank), key=statistics.median)


def time_rows(measured: dict, common: dict, tokens: int) -> list:
    """Per variant: the training step (vs ZeroRedundancyOptimizer's) and ``step()`` alone."""
    baseline = None
    if "zero-redundancy" in measured:
        baseline = statistics.median(slowest(measured["zero-redundancy"], "train_ms"))
    rows = []
    for variant, per_rank in measured.items():
        peaks = [step_peak(m["memory"]) for m in per_rank]
        for kernel, samples in (
            ("zero1/train-step", slowest(per_rank, "train_ms")),
            ("zero1/optimizer-step", slowest(per_rank, "step_ms")),
        ):
            p20, p50, p80 = results.quantiles(samples)
            whole_step = kernel == "zero1/train-step"
            rows.append(results.Row(
                kernel=kernel, provider=variant, p20=p20, p50=p50, p80=p80,
                mean=statistics.mean(samples), std=statistics.pstdev(samples),
                throughput=tokens / (statistics.mean(samples) / 1e3) if whole_step else None,
                throughput_unit="tok/s" if whole_step else "",
                speedup_vs_baseline=baseline / p50 if baseline and whole_step else None,
                memory_gib=max(peaks) / GIB if whole_step and None not in peaks else None,
                config="slowest rank; vs baseline: ZeroRedundancyOptimizer's p50 / this; memory: "
                       "the step's peak, largest rank" if whole_step else
                       "optimizer.step() alone, with the re-sync; slowest rank",
                **common,
            ))  # fmt: skip
    return rows


def memory_rows(measured: dict, common: dict) -> list:
    """Per variant and phase, on the rank with the largest peak: the peak and its parts."""
    nan, rows = float("nan"), []
    for variant, per_rank in measured.items():
        for phase in PHASES:
            rank = max(
                range(len(per_rank)), key=lambda r: per_rank[r]["memory"][phase]["peak"] or 0
            )
            parts = per_rank[rank]["memory"][phase]
            for part in ("peak", *PARTS):
                rows.append(results.Row(
                    kernel=f"zero1/memory/{part}", provider=variant, p20=nan, p50=nan, p80=nan,
                    memory_gib=None if parts[part] is None else parts[part] / GIB,
                    config=f"rank {rank} (the largest peak of the phase)",
                    **{**common, "mode": phase},
                ))  # fmt: skip
    return rows


def accounting(measured: dict, predicted: dict, common: dict) -> tuple[list, list[str]]:
    """Measured vs predicted optimizer state and peak saving: (rows, target lines)."""
    nan, rows, targets = float("nan"), [], []
    common = {**common, "mode": "accounting"}
    for variant, per_rank in measured.items():
        state = [m["memory"]["step"]["optimizer-state"] for m in per_rank]
        expected = max(predicted[variant])
        rows.append(results.Row(
            kernel="zero1/optimizer-state", provider=variant, p20=nan, p50=nan, p80=nan,
            memory_gib=max(state) / GIB, roofline_fraction=max(state) / expected,
            config=f"largest rank; of roofline = measured / predicted ({expected / GIB:.3f} "
                   f"GiB); per rank {[round(b / GIB, 3) for b in state]} GiB",
            **common,
        ))  # fmt: skip
    if "sharded" in measured:
        world_size = len(measured["sharded"])
        largest = max(m["memory"]["step"]["optimizer-state"] for m in measured["sharded"])
        bound = 1.05 * predicted["adamw"][0] / world_size + predicted["largest_param_state"]
        targets.append(
            f"largest per-rank optimizer state {largest / GIB:.3f} GiB <= 1.05 x total/N + "
            f"largest param = {bound / GIB:.3f} GiB: {'met' if largest <= bound else 'MISSED'} "
            f"(owned elements in elements per rank: {predicted['owned_elements']})"
        )
    for variant in ("sharded", "zero-redundancy"):
        if variant not in measured or "adamw" not in measured:
            continue
        savings = []  # (measured, predicted, rank): the saving of a step's peak vs plain AdamW
        for rank, (plain, ours) in enumerate(
            zip(measured["adamw"], measured[variant], strict=True)
        ):
            peaks = step_peak(plain["memory"]), step_peak(ours["memory"])
            saving = None if None in peaks else peaks[0] - peaks[1]
            savings.append((saving, predicted["adamw"][rank] - predicted[variant][rank], rank))
        saving, expected, rank = min(savings, key=lambda s: s[0] or 0)  # the smallest saving
        ratio = None if saving is None else saving / expected
        rows.append(results.Row(
            kernel="zero1/peak-saving", provider=variant, p20=nan, p50=nan, p80=nan,
            memory_gib=None if saving is None else saving / GIB, roofline_fraction=ratio,
            config=f"a step's peak vs plain AdamW's, rank {rank} (the smallest saving); of "
                   f"roofline = measured / predicted ({expected / GIB:.3f} GiB)",
            **common,
        ))  # fmt: skip
        if ratio is not None:
            verdict = "met" if abs(ratio - 1) <= 0.05 else "MISSED"
            targets.append(
                f"{variant}: peak saving {saving / GIB:.3f} GiB vs predicted "
                f"{expected / GIB:.3f} GiB = {ratio:.3f} (target within 5%): {verdict}"
            )
    if "sharded" in measured and "zero-redundancy" in measured:
        ours, theirs = (statistics.median(slowest(measured[v], "train_ms"))
                        for v in ("sharded", "zero-redundancy"))  # fmt: skip
        verdict = "met" if ours <= 1.1 * theirs else "MISSED"
        targets.append(
            f"sharded training step {ours / theirs:.3f}x ZeroRedundancyOptimizer's "
            f"(target <= 1.1x): {verdict}"
        )
    return rows, targets


def build_rows(measured: dict, predicted: dict, args, device) -> tuple[list, list[str]]:
    """(CSV rows, target lines). ``measured[variant][rank]`` is what :func:`measure` returned."""
    world_size = len(next(iter(measured.values())))
    common = {
        # One GPU shared over gloo: memory per rank is real, step times are gloo's.
        "mode": f"train, {world_size} ranks on one GPU over gloo" if args.one_gpu else "train",
        "x": f"{args.size} ctx={args.context_length} batch={args.batch_size}/rank x{world_size}",
        "dtype": args.dtype,
        "gpu": results.device_name(device),
        "version": torch.__version__,
        "timestamp": results.timestamp(),
    }
    tokens = world_size * args.batch_size * args.context_length
    rows = time_rows(measured, common, tokens) + memory_rows(measured, common)
    checked, targets = accounting(measured, predicted, common)
    return rows + checked, targets


def memory_table(rows: list) -> str:
    """The memory rows as one line per variant and phase: peak and its parts, in GiB."""
    memory = {(r.provider, r.mode, r.kernel.rsplit("/", 1)[1]): r.memory_gib for r in rows
              if r.kernel.startswith("zero1/memory/")}  # fmt: skip
    lines = [
        "| variant | phase | peak | params | grads | optimizer state | rest |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for variant, phase in dict.fromkeys((v, m) for v, m, _ in memory):
        cells = [memory[variant, phase, part] for part in ("peak", *PARTS)]
        text = " | ".join("n/m" if c is None else f"{c:.3f}" for c in cells)
        lines.append(f"| {variant} | {phase} | {text} |")
    return "\n".join(lines)


def plot(rows: list, path: Path) -> Path:
    """Stacked memory bars per variant and phase; train-step and step() times per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = {(r.provider, r.mode, r.kernel.rsplit("/", 1)[1]): r.memory_gib for r in rows
              if r.kernel.startswith("zero1/memory/")}  # fmt: skip
    variants = list(dict.fromkeys(r.provider for r in rows if r.kernel == "zero1/train-step"))
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), width_ratios=(3, 1))
    ticks, labels, x = [], [], 0.0
    for variant in variants:
        for phase in PHASES:
            bottom = 0.0
            for i, part in enumerate(PARTS):
                height = memory.get((variant, phase, part)) or 0.0
                left.bar(x, height, bottom=bottom, color=f"C{i}", label=part if x == 0 else None)
                bottom += height
            ticks.append(x)
            labels.append(f"{variant}\n{phase}")
            x += 1
        x += 0.5  # a gap between variants
    left.set_xticks(ticks, labels, fontsize=7)
    left.set_ylabel("GiB (peak of the phase, largest rank)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3, axis="y")
    width = 0.4
    for offset, kernel in ((0.0, "zero1/train-step"), (width, "zero1/optimizer-step")):
        times = {r.provider: r.p50 for r in rows if r.kernel == kernel}
        bars = [times.get(v, 0.0) for v in variants]
        right.bar([i + offset for i in range(len(variants))], bars, width,
                  label=kernel.split("/")[1])  # fmt: skip
    right.set_xticks([i + width / 2 for i in range(len(variants))], variants, fontsize=7)
    right.set_ylabel("ms (p50)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3, axis="y")
    gpu = rows[0].gpu if rows else ""
    fig.suptitle(f"ZeRO-1 with AdamW: memory and step time ({rows[0].x if rows else ''}, {gpu})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- main -----------------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_args(argv)
    on_cuda = torch.cuda.is_available()
    fill_device_defaults(args, on_cuda)
    if on_cuda:
        torch.cuda.set_device(0 if args.one_gpu else int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_cuda and not args.one_gpu else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    try:
        measured = {}
        for variant in args.variants:
            mine = measure(variant, args, device)
            measured[variant] = [None] * world_size
            dist.all_gather_object(measured[variant], mine)
            if rank == 0:
                print(f"{variant}: measured", flush=True)
        if rank != 0:
            return
        numels = measured[args.variants[0]][0]["numels"]
        predicted = predicted_state_bytes(numels, torch.float32.itemsize, world_size)
        rows, targets = build_rows(measured, predicted, args, device)
        slug = results.device_slug(device)
        csv = results.write_csv(rows, args.out / f"{slug}.csv")
        print(results.markdown_table([r for r in rows if "/memory/" not in r.kernel]))
        print("\nPeak memory by phase, GiB (largest rank; n/m: not measured on CPU):\n")
        print(memory_table(rows))
        print("\nTargets (recorded, not asserted):\n" + "\n".join(f"- {t}" for t in targets))
        left_over = {v: max(m["left_over"] for m in per) / GIB for v, per in measured.items()}
        print(f"memory still allocated when each variant started (GiB): {left_over}")
        try:
            print(f"wrote {csv} and {plot(rows, csv.with_suffix('.png'))}")
        except ImportError:  # a GPU host without matplotlib still gets the CSV
            print(f"wrote {csv} (no plot: matplotlib is not installed)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
