"""ddp sweep: all-reduce bandwidth and the data-parallel strategies, each launched with torchrun.
Writes ``results/<gpu>.csv`` (the shared schema) and ``results/<gpu>.png``; the ``bench`` main
job calls :func:`run`.

On a host with 2 or more GPUs: NCCL all-reduce of 1 MB to 1 GB float32 on 2, 4, 6 and 8 ranks as
the host has GPUs, gloo on the host's CPU cores with 2, 4 and 6 processes (1 to 100 MB), and the
strategy benchmark (xl, context 512, batch 4 per GPU, bf16), FSDP on xl and the 9.7B FSDP run
on 2 GPUs (``--full``: FSDP on 2.7B too). On one GPU only the gloo
rows run. On a CPU-only machine: gloo with 2 processes and the strategies on the tiny model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

import llmsys.bench_harness as harness
from llmsys.bench_harness import results

HERE = Path(__file__).parent
RESULTS = HERE / "results"


def _gpus(device: str) -> int:
    return torch.cuda.device_count() if device == "cuda" else 0


def commands(device: str, quick: bool, full: bool = False) -> list[tuple[str, int, list[str]]]:
    """(script, processes, arguments) of every torchrun launch this sweep makes on ``device``;
    ``full`` adds FSDP on the 2.7B model."""
    gpus = _gpus(device)
    small = quick or gpus == 0
    gloo_sizes = ["1", "10"] if small else ["1", "10", "100"]
    gloo_ranks = [2] if small else [n for n in (2, 4, 6) if n <= (os.cpu_count() or 1)]
    runs = [("all_reduce.py", n, ["--backend", "gloo", "--sizes-mb", *gloo_sizes,
             "--rounds", "3" if small else "5"]) for n in gloo_ranks]  # fmt: skip
    if gpus >= 2:
        runs += [("all_reduce.py", n, ["--backend", "nccl"]) for n in (2, 4, 6, 8) if n <= gpus]
        once = ["--rounds", "1"] if quick else []
        runs.append(("strategies.py", 2, ["--size", "tiny" if quick else "xl", *once]))
        for size in ["tiny"] if quick else ["xl", "2.7B"] if full else ["xl"]:
            runs.append(("fsdp.py", 2, ["--size", size, "--checkpointing", "both", *once]))
        if not quick:
            runs.append(("fsdp.py", 2, ["--largest", "10B", "--steps", "4"]))
    elif gpus == 0:
        tiny = ["--size", "tiny", "--context-length", "32", "--batch-size", "2"]
        few = ["--steps", "2", "--warmup", "1", "--rounds", "1"]
        runs.append(("strategies.py", 2, [*tiny, "--dtype", "fp32", *few]))
        runs.append(("fsdp.py", 2, [*tiny, *few, "--checkpointing", "both"]))
    return runs


def skipped(device: str) -> list[str]:
    if device == "cuda" and _gpus(device) < 2:
        return ["NCCL all-reduce and the data-parallel strategies: need 2 GPUs, this host has 1 "
                "(the committed h200 results come from 2 H200s)"]  # fmt: skip
    return []


def torchrun(script: str, processes: int, arguments: list[str]) -> list[results.Row]:
    """Launch ``script`` on ``processes`` ranks; the rows its rank 0 wrote."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch, "rows.csv")
        harness.torchrun(HERE / script, processes, [*arguments, "--out", str(out)])
        return results.read_rows(out)


def run(
    device: str = "cuda",
    *,
    quick: bool = False,
    progress=None,
    full: bool = False,
    announce: bool = False,
) -> list[results.Row]:
    """Every launch of ``commands``; ``announce`` prints each one as it starts (a launch takes
    from seconds on a CPU to minutes on GPUs, with no output of its own until it ends)."""
    rows = []
    launches = commands(device, quick, full)
    for number, (script, processes, arguments) in enumerate(launches, 1):
        if announce:
            shown = " ".join(f"'{a}'" if " " in a else a for a in arguments)
            print(f"[{number}/{len(launches)}] torchrun --nproc-per-node {processes} {script} "
                  f"{shown}", flush=True)  # fmt: skip
        rows += torchrun(script, processes, arguments)
        if progress:
            progress()
    return rows


def report_markdown(rows: list[results.Row]) -> str:
    reduce = [r for r in rows if r.kernel == "all_reduce"]
    steps = [r for r in rows if r.kernel == "transformer_lm/data_parallel"]
    sharded = [
        r for r in rows if r.kernel.startswith(("transformer_lm/sharded", "transformer_lm/larg"))
    ]
    parts = []
    if reduce:
        parts.append("### All-reduce (float32; throughput is bus bandwidth)\n\n"
                     + results.markdown_table(reduce))  # fmt: skip
    if steps:
        parts.append("### Training step per strategy (`time / baseline`: this one's time over "
                     "torch DDP's; the config column has exposed and total communication)\n\n"
                     + results.markdown_table(steps))  # fmt: skip
    if sharded:
        notes = "\n".join(f"| {r.x} | {r.mode} | {r.provider} | {r.config} |" for r in sharded)
        parts.append("### Sharded training: DDP, ZeRO-1, FSDP and torch FSDP2 (`time / baseline`: "
                     "this one's time over one GPU (on a CPU: process) alone's; the notes give "
                     "step times over another's too)\n\n" + results.markdown_table(sharded)
                     + "\n\n| case | mode | provider | predicted peak, ratios, communication |\n"
                     "|---|---|---|---|\n" + notes)  # fmt: skip
    return "\n\n".join(parts)


def plot(rows: list[results.Row], path: Path) -> Path:
    """Left: all-reduce bus bandwidth against size. Right: step time per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sharded = [r for r in rows if r.kernel == "transformer_lm/sharded_training"]
    fig, axes = plt.subplots(1, 3 if sharded else 2, figsize=(20 if sharded else 13, 5))
    left, right = axes[0], axes[1]
    reduce = [r for r in rows if r.kernel == "all_reduce"]
    for key in dict.fromkeys((r.provider, r.mode) for r in reduce):
        mine = [r for r in reduce if (r.provider, r.mode) == key]
        sizes = [float(r.x.split()[0]) for r in mine]
        left.plot(sizes, [r.throughput for r in mine], marker="o", label=" ".join(key))
    left.set(xscale="log", yscale="log", xlabel="MB", ylabel="bus bandwidth GB/s")
    left.set_title("all-reduce")
    left.grid(alpha=0.3, which="both")
    if reduce:
        left.legend(fontsize=8)
    steps = [r for r in rows if r.kernel == "transformer_lm/data_parallel"]
    if steps:
        right.barh([r.provider for r in steps], [r.p50 for r in steps], color="tab:blue")
        floor = next((r.p50 for r in steps if r.provider == "no communication"), None)
        if floor:
            right.axvline(floor, color="gray", ls="--", label="no communication")
            right.axvline(1.15 * floor, color="tab:red", ls=":", label="1.15x no communication")
            right.legend(fontsize=8)
        right.invert_yaxis()
        right.set_xlabel("ms per training step (median, slowest rank)")
        right.set_title(f"{steps[0].x}, {steps[0].mode}, {steps[0].dtype}")
    if sharded:
        labels = [f"{r.x.split()[0]}{' ckpt' if 'checkpointing' in r.mode else ''} {r.provider}"
                  for r in sharded]  # fmt: skip
        axes[2].barh(labels, [r.memory_gib or 0 for r in sharded], color="tab:green")
        axes[2].invert_yaxis()
        axes[2].tick_params(axis="y", labelsize=7)
        axes[2].set_xlabel("peak GiB per GPU (bar) and ms per step (label)")
        for y, r in enumerate(sharded):
            axes[2].annotate(f"{r.p50:.0f} ms", (r.memory_gib or 0, y), fontsize=7, va="center")
        axes[2].set_title("sharded training, 2 ranks")
    return harness.save_figure(fig, path, "llmsys-ddp")


def main() -> None:
    parser = harness.sweep_arguments(__doc__.splitlines()[0], RESULTS, "the smallest cases")
    parser.add_argument("--full", action="store_true", help="FSDP on the 2.7B model too")
    args = parser.parse_args()
    if args.replot:
        print(harness.replot(args.replot, plot))
        return
    rows = run(args.device, quick=args.quick, full=args.full, announce=True)
    csv = harness.write_csv(rows, args.out / f"{harness.device_slug(args.device)}.csv")
    print(report_markdown(rows))
    print(f"wrote {csv} and {plot(rows, csv.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
