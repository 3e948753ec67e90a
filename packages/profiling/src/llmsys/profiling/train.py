"""Data-parallel training of a Hugging Face Llama under torchrun: our wrappers against torch's.

    torchrun --nproc-per-node 4 -m llmsys.profiling.cli train --model 8b --seq-len 8192 \\
        --batch-size 1 --strategies fsdp fsdp2 --compile --checkpointing full
    torchrun --nproc-per-node 2 -m llmsys.profiling.cli train --quick --device cpu

The model (``--model``) is one of the ``llama`` subcommand's Llama presets with random weights
(0.85b, 3b or 8b: Llama-3.1-8B's shape), float32 weights, AdamW (lr 1e-4, betas (0.9, 0.95),
weight decay 0.1; fused on CUDA), ``--kernels llmsys`` after ``llmsys.hf.apply_llmsys``. Every
strategy (``--strategies``; see ``train_strategies``) is built afresh from the same weights,
with ``--checkpointing full`` (Hugging Face's non-reentrant checkpointing of every decoder
layer) and ``--compile`` (each decoder layer compiled) applied before it wraps the model. The
strategies take turns in ``--rounds`` rounds; ``one-gpu``, each rank training alone, always
runs first, as the baseline. On CUDA each rank uses its GPU (``cuda:LOCAL_RANK``, NCCL); on the
CPU (``--device cpu``), gloo.

The data: every rank trains on the same seeded batch of ``--batch-size`` x ``--seq-len`` random
tokens (the loss from the model's forward, ``labels=``). The data-parallel gradient, the mean
of the ranks' gradients, is then the one-gpu gradient, so every strategy's loss curve should
follow one-gpu's up to rounding: to about 1e-6 for the DDPs and ZeROs (the same bf16 autocast,
a mean of equal gradients), to bf16 rounding for the FSDPs (their mixed-precision policies
differ from autocast). The loss is the mean over the ranks of each rank's loss, every step.

Per strategy (rank 0 prints them and writes ``<out>/train.csv``, ``train-loss.csv``, each step's
loss, and ``train.png``): the step time (barrier to the slowest rank's end; median and p20-p80
over every round's timed steps), its ratio to one-gpu's, tokens/s per GPU, MFU (model FLOPs of
the forward and backward, recomputation not counted, over the GPU's dense bf16 peak), the peak
memory allocated (the largest over the ranks) beside the accounting model's prediction
(``llmsys-roofline memory``: float32 weights, gradients and AdamW moments sharded as the
strategy shards them, bf16 activations; it leaves out the logits and temporary buffers), the
exposed communication (the step minus one-gpu's), the NCCL kernels' time in one profiled step
(CUDA), and the final loss against one-gpu's. A strategy that runs out of memory, or that a
wrapper refuses, gets a row saying so and the run goes on. ``--quick``: a tiny one-layer Llama,
2 x 16 tokens per rank, 2 steps: a smoke test. Needs transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int

from . import rounds, train_strategies, training
from .infra import accounting, memory_model
from .llama import MODELS, TINY, build_llama, kernels_of
from .train_strategies import CHECKPOINTING, STRATEGIES

HELP = "data-parallel training of a Hugging Face Llama under torchrun: ours against torch's"
BASELINE = "one-gpu"
QUICK = dict(seq_len=16, batch_size=2, steps=2, warmup=0, rounds=1)
FULL = dict(seq_len=8192, batch_size=1, steps=5, warmup=2, rounds=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", choices=MODELS, default="8b",
        help="the Llama preset: 0.85b, 3b (Llama-3.2-3B's shape) or 8b (Llama-3.1-8B's shape)",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="a tiny one-layer Llama, 2x16 tokens per rank, 2 steps, 1 round (a smoke test)",
    )  # fmt: skip
    parser.add_argument("--seq-len", type=positive_int,
                        help="tokens per sequence (default 8192; with --quick, 16)")  # fmt: skip
    parser.add_argument("--batch-size", type=positive_int,
                        help="sequences per rank (default 1; with --quick, 2)")  # fmt: skip
    parser.add_argument(
        "--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES),
        help="what to compare (default: all); one-gpu, the baseline, always runs",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true", help="compile each decoder layer (torch.compile)"
    )
    parser.add_argument(
        "--checkpointing", choices=CHECKPOINTING, default="none",
        help="activation checkpointing: none, or full (every decoder layer, non-reentrant)",
    )  # fmt: skip
    parser.add_argument(
        "--kernels", choices=("stock", "llmsys"), default="stock",
        help="the model as transformers builds it, or after llmsys.hf.apply_llmsys",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=positive_int, help="timed steps per strategy, round (default 5; --quick 2)"
    )
    parser.add_argument("--warmup", type=non_negative_int,
                        help="untimed steps first, each round (default 2; --quick 0)")  # fmt: skip
    parser.add_argument("--rounds", type=positive_int,
                        help="rounds over the strategies (default 2; --quick 1)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Setup:
    """One run's settings, the defaults (``FULL`` or ``QUICK``) filled in."""

    name: str  # the model's name in rows: a preset, or "tiny"
    sizes: dict[str, Any]
    seq_len: int
    batch_size: int
    steps: int
    warmup: int
    rounds: int
    compile: bool
    checkpointing: str
    kernels: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Setup:
        defaults = QUICK if args.quick else FULL
        given = {key: getattr(args, key) for key in defaults}
        return cls(
            name="tiny" if args.quick else args.model,
            sizes=dict(TINY if args.quick else MODELS[args.model]),
            **{key: defaults[key] if value is None else value for key, value in given.items()},
            compile=args.compile,
            checkpointing=args.checkpointing,
            kernels=args.kernels,
        )

    @property
    def mode(self) -> str:
        """The rows' ``mode``: e.g. "compiled, full ckpt"."""
        mode = f"{'compiled' if self.compile else 'eager'}, "
        mode += "full ckpt" if self.checkpointing == "full" else "no ckpt"
        return mode + (", llmsys kernels" if self.kernels == "llmsys" else "")


def measure(
    name: str, setup: Setup, data: torch.Tensor, device: torch.device, profiled: bool
) -> dict[str, Any]:
    """Build strategy ``name`` from the seeded weights and time its steps on ``data``: the
    slowest rank's step times, its peak GiB, the NCCL kernels' time in one profiled step
    (``profiled``, on CUDA) and the loss of every step (the mean over ranks)."""
    torch.manual_seed(0)
    model = build_llama(setup.sizes, device, torch.float32).train()
    with kernels_of(setup.kernels, model):
        train_strategies.prepare(model, compile=setup.compile, checkpointing=setup.checkpointing)
        trainer = train_strategies.build(name, model, device)
    world_size = dist.get_world_size()
    autocast = STRATEGIES[name].autocast
    losses: list[torch.Tensor] = []

    def step() -> None:
        with training.autocast("bf16" if autocast else "fp32", device):
            loss = trainer.model(input_ids=data, labels=data, use_cache=False).loss
        loss.backward()
        if trainer.finish is not None:
            trainer.finish()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())

    times, peak = rounds.timed_steps(step, setup.warmup, setup.steps, device, world_size)
    curve = torch.stack(losses)
    dist.all_reduce(curve)  # (gloo has no AVG)
    communicates = not STRATEGIES[name].alone and world_size > 1
    nccl_ms = rounds.nccl_kernel_ms(step, device) if communicates and profiled else None
    if name != "fsdp2":  # (its parameters are DTensors, freed with the module)
        rounds.release(trainer.model, trainer.optimizer)
    return {
        "times_ms": [rounds.slowest(t, device) * 1e3 for t in times],
        "peak_gib": rounds.slowest(peak, device) if peak is not None else None,
        "nccl_ms": nccl_ms,
        "losses": (curve / world_size).tolist(),
        "status": "",
    }


def measure_or_say_why(
    name: str, setup: Setup, data: torch.Tensor, device: torch.device, profiled: bool
) -> dict[str, Any]:
    """:func:`measure`, or a measurement without times saying why there is none: out of
    memory, or the error a wrapper (or compile, or checkpointing) raised."""
    status = "out of memory"
    try:
        measured = training.unless_out_of_memory(
            lambda: measure(name, setup, data, device, profiled), device
        )
    except Exception as error:
        status = f"failed: {type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
        measured = None
        training.free_device_memory(device)
    if measured is not None:
        return measured
    return {"times_ms": [math.nan], "peak_gib": None, "nccl_ms": None, "losses": [],
            "status": status}  # fmt: skip


def predicted_gib(name: str, setup: Setup, world_size: int) -> float:
    """The accounting model's peak GiB per GPU for strategy ``name`` (``llmsys-roofline
    memory``'s; see ``memory_model.training_peak``)."""
    strategy = STRATEGIES[name]
    return memory_model.training_peak(
        memory_model.from_llama(setup.sizes), strategy.memory,
        1 if strategy.alone else world_size,
        tokens_per_device=setup.batch_size * setup.seq_len,
        checkpointing=setup.checkpointing == "full", compute="bf16",
    ) / 2**30  # fmt: skip


def rows_for(
    measured: dict[str, dict[str, Any]], setup: Setup, world_size: int, device: torch.device
) -> list[results.Row]:
    """One row per strategy; ``config`` carries the predicted peak, the exposed communication,
    the NCCL time and the final loss against one-gpu's, or why there is no measurement."""
    tokens = setup.batch_size * setup.seq_len
    flops = 3 * accounting.llama_forward_flops(setup.sizes, setup.batch_size, setup.seq_len)
    peak_flops, peak_source = accounting.peak_flops(results.device_name(device), "bf16")
    base = measured[BASELINE]
    base_ms = statistics.median(base["times_ms"])
    base_ms = None if math.isnan(base_ms) else base_ms
    rows = []
    for name, m in measured.items():
        p20, p50, p80 = results.quantiles(m["times_ms"])
        timed = not math.isnan(p50)
        notes = [m["status"]] if m["status"] else []
        notes.append(f"predicted peak {predicted_gib(name, setup, world_size):.3g} GiB")
        if timed and base_ms and name != BASELINE and world_size > 1:
            notes.append(f"exposed communication {p50 - base_ms:.1f} ms")
        if m["nccl_ms"]:
            notes.append(f"NCCL kernels {m['nccl_ms']:.1f} ms/step")
        if m["losses"]:
            notes.append(f"final loss {m['losses'][-1]:.5f}")
            if base["losses"] and name != BASELINE:
                gap = max(abs(a - b) for a, b in zip(m["losses"], base["losses"], strict=True))
                notes.append(f"largest loss gap to one-gpu's {gap:.2e}")
        if peak_flops and timed:
            notes.append(f"MFU vs {peak_source}")
        rows.append(
            results.Row(
                kernel=f"train/{setup.name}", provider=name, mode=setup.mode,
                x=f"{setup.name} seq{setup.seq_len} b{setup.batch_size}/rank x{world_size}",
                dtype="bf16", p20=p20, p50=p50, p80=p80,
                throughput=tokens / (p50 / 1e3) if timed else None,
                throughput_unit="tok/s/GPU",
                roofline_fraction=flops / (p50 / 1e3) / peak_flops
                if peak_flops and timed else None,
                speedup_vs_baseline=base_ms / p50 if base_ms and timed else None,
                config="; ".join(notes), **rounds.run_fields(m, device),
            )
        )  # fmt: skip
    return rows


def write_losses(measured: dict[str, dict[str, Any]], path: Path) -> Path:
    """Every step's loss (warm-up steps included), one line per strategy and step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as file:
        file.write("step,strategy,loss\n")
        for name, m in measured.items():
            file.writelines(f"{i},{name},{loss!r}\n" for i, loss in enumerate(m["losses"]))
    return path


def plot(
    rows: list[results.Row], measured: dict[str, dict[str, Any]], predicted: dict[str, float],
    path: Path,
) -> Path:  # fmt: skip
    """Three panels: time / one-gpu's per strategy, peak memory against the prediction, and
    each strategy's loss per step."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg

    fig = Figure(figsize=(15, 4), layout="constrained")
    ratio_ax, memory_ax, loss_ax = fig.subplots(1, 3)
    names = [r.provider for r in rows]
    ratios = [1 / r.speedup_vs_baseline if r.speedup_vs_baseline else 0.0 for r in rows]
    ratio_ax.bar(names, ratios, color="C0")
    ratio_ax.axhline(1.0, color="black", linewidth=0.8)
    ratio_ax.set(title="step time / one-gpu's (lower is faster)", ylabel="ratio")
    positions = range(len(rows))
    memory_ax.bar([p - 0.2 for p in positions], [r.memory_gib or 0.0 for r in rows], 0.4,
                  label="measured (max over ranks)")  # fmt: skip
    memory_ax.bar([p + 0.2 for p in positions], [predicted[n] for n in names], 0.4,
                  label="predicted (llmsys-roofline memory)")  # fmt: skip
    memory_ax.set_xticks(list(positions), names)
    memory_ax.set(title="peak memory per GPU", ylabel="GiB")
    memory_ax.legend(fontsize="small")
    for name, m in measured.items():
        if m["losses"]:
            loss_ax.plot(m["losses"], label=name, linewidth=1, marker=".")
    loss_ax.set(title="loss (mean over ranks)", xlabel="step", ylabel="loss")
    loss_ax.legend(fontsize="small")
    for ax in (ratio_ax, memory_ax):
        ax.tick_params(axis="x", rotation=30, labelsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def details_table(rows: list[results.Row]) -> str:
    """The columns ``results.markdown_table`` has no room for, one line per strategy."""
    lines = [
        f"| strategy | step ms p50 (p20-p80) | {results.TIME_RATIO_HEADER} | tok/s per GPU "
        "| peak GiB, max over ranks | notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        timed = not math.isnan(r.p50)
        step = f"{r.p50:.1f} ({r.p20:.1f}-{r.p80:.1f})" if timed else ""
        ratio = f"{1 / r.speedup_vs_baseline:.2f}x" if r.speedup_vs_baseline else ""
        rate = f"{r.throughput:,.0f}" if r.throughput else ""
        memory = f"{r.memory_gib:.3g}" if r.memory_gib is not None else ""
        lines.append(f"| {r.provider} | {step} | {ratio} | {rate} | {memory} | {r.config} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[results.Row] | None:
    """Measure every strategy on every rank; rank 0 returns the rows (and writes the loss
    curves and the plot), the other ranks None.

    Raises:
        SystemExit: ``--device`` names a CUDA device by index (each rank takes its own).
    """
    from llmsys.ddp import local_device

    setup = Setup.from_args(args)
    requested = torch.device(args.device)
    if requested.type == "cuda" and requested.index is not None:
        raise SystemExit("train: --device cuda takes no index: each rank uses cuda:LOCAL_RANK")
    rank, world_size, owned = join(requested.type)
    device = local_device() if requested.type == "cuda" else torch.device("cpu")
    data = torch.randint(
        0, setup.sizes["vocab_size"], (setup.batch_size, setup.seq_len),
        generator=torch.Generator().manual_seed(0),
    ).to(device)  # fmt: skip
    names = [BASELINE] + [n for n in args.strategies if n != BASELINE]

    def measure_one(name: str, first_round: bool) -> dict[str, Any]:
        return measure_or_say_why(name, setup, data, device, profiled=first_round)

    def report(name: str, m: dict[str, Any]) -> None:
        if rank == 0:
            said = m["status"] or f"{statistics.median(m['times_ms']):.1f} ms"
            print(f"train: {name:13s} {said}", flush=True)

    measured = rounds.interleaved(measure_one, names, setup.rounds, report, medians=("nccl_ms",))
    dist.barrier()
    if owned:
        dist.destroy_process_group()
    if rank != 0:
        return None
    rows = rows_for(measured, setup, world_size, device)
    version = f"torch {torch.__version__}, transformers {_transformers_version()}"
    for row in rows:
        row.version = version
    print(details_table(rows) + "\n")
    out = Path(args.out)
    print(f"wrote {write_losses(measured, out / 'train-loss.csv')}")
    try:
        predicted = {name: predicted_gib(name, setup, world_size) for name in measured}
        print(f"wrote {plot(rows, measured, predicted, out / 'train.png')}")
    except ImportError:
        print("train: matplotlib is not installed; no plot")
    return rows


def join(device_type: str) -> tuple[int, int, bool]:
    """Join torchrun's process group (NCCL on CUDA, gloo on the CPU), or, in a plain run, make
    a group of this one process (FSDP2 and the collectives need one); returns (rank, world
    size, whether this call made the group: who made it tears it down)."""
    from llmsys.ddp import init_distributed

    backend = "nccl" if device_type == "cuda" else "gloo"
    owned = not dist.is_initialized()
    if owned and "RANK" not in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    rank, world_size = init_distributed(backend)
    return rank, world_size, owned


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
