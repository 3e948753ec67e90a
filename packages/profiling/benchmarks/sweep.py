"""Profiling sweep: the Transformer LM end to end (the targets), memory, profiler, attention and
precision, through the same code as ``llmsys-bench``. Writes ``results/<gpu>.csv`` (the shared
schema) and ``results/<gpu>.png``; the ``bench`` main job calls :func:`run`.

On a GPU, the default runs the case the README tables quote (medium at context 1024, batch 4,
bf16 autocast, train step: eager / compiled / llmsys presets and compiled with CUDA graphs) and
the precision tables, a few minutes; ``--full`` adds the warm-up effect (first, in a cold
process), xl with llmsys, the memory table of the small model, three profiles, the attention
sweep at d 64 and 128, the Hugging Face Llama (about 4 minutes), the 8B Llama served (about 15),
the other compile modes, every size at contexts 128 to 1024 for every preset, the medium model's
memory table and the whole attention grid (d 16 to 128, seq 256 to 16384). On a CPU: the tiny
model, each subcommand once. Traces, snapshots and the memory timeline go to
``results/<gpu>-artifacts/`` (not committed).
"""

from __future__ import annotations

import time
from pathlib import Path

import llmsys.bench_harness as harness
from llmsys.bench_harness import results
from llmsys.profiling import cli

RESULTS = Path(__file__).parent / "results"


def commands(device: str, quick: bool, full: bool) -> list[list[str]]:
    """The llmsys-bench command lines this sweep runs on ``device``."""
    if device != "cuda" or quick:
        tiny = ["--size", "tiny", "--context-length", "32", "--batch-size", "2"]
        return [
            ["e2e", *tiny, "--preset", "eager", "compiled", "--steps", "2", "--warmup", "1"],
            ["memory", *tiny, "--dtype", "fp32"],
            ["profile", *tiny, "--preset", "eager", "--steps", "1", "--warmup", "1"],
            ["attention", "--head-dim", "16", "--seq-len", "32", "--passes", "2"],
            ["precision"],
            ["llama", "--quick", "--warmup", "0", "--reps", "1"],
            ["serve", "--quick", "--warmup", "0", "--reps", "1", "--providers", "fp16",
             "int8-fused", "--generate"],
            ["train", "--quick"],  # one process: every strategy on a group of one
        ]  # fmt: skip
    presets = ["--preset", "eager", "compiled", "llmsys"]
    target = ["--context-length", "1024", "--batch-size", "4", "--dtype", "bf16"]
    # The default run (the main job's ten minutes): the target case of the README tables.
    default = [
        ["e2e", "--size", "medium", *target, *presets],
        ["e2e", "--size", "medium", *target, "--preset", "compiled",
         "--compile-mode", "reduce-overhead"],
        ["precision"],
    ]  # fmt: skip
    if not full:
        return default
    runs = [
        # first, while the process is cold (CUDA context, cuBLAS, compile caches): the warm-up
        ["e2e", "--size", "small", "--context-length", "512", "--preset", "eager",
         "--warmup", "0", "1", "2", "5"],
        *default,
        ["e2e", "--size", "xl", *target, "--preset", "llmsys"],
        ["memory", "--size", "small"],
        ["profile", "--size", "small", "--context-length", "512", "--preset", "eager"],
        ["profile", "--size", "medium", *target, "--preset", "compiled", "llmsys"],
        ["attention", "--head-dim", "64", "128", "--seq-len", "1024", "4096", "16384"],
        ["llama"],  # the 0.85B Hugging Face Llama: int8 inference, training (about 4 min)
        ["serve", "--model", "8b"],  # Llama-3.1-8B's shape served (about 15 min: compiles)
        # every strategy on a group of one GPU (torchrun for more: the README's commands)
        ["train", "--model", "0.85b", "--seq-len", "2048", "--batch-size", "2"],
    ]  # fmt: skip
    sizes = ["small", "medium", "large", "xl", "2.7B"]
    contexts = ["128", "256", "512", "1024"]
    runs += [
        ["e2e", "--size", "medium", *target, "--preset", "llmsys", "--compile-mode",
         "default"],
        ["e2e", "--size", "medium", *target, "--preset", "llmsys", "--no-compile"],
        ["e2e", "--size", "xl", *target, "--preset", "compiled"],
        ["e2e", "--size", "small", "--context-length", "512", "--preset", "llmsys",
         "--warmup", "0", "1", "2", "5"],
        ["e2e", "--size", *sizes, "--context-length", *contexts, *presets],
        ["memory", "--size", "medium"],
        ["attention"],
    ]  # fmt: skip
    return runs


def run(device: str = "cuda", *, quick: bool = False, progress=None, full: bool = False):
    """Run every command; the rows of all of them, in the shared schema."""
    out = RESULTS / f"{harness.device_slug(device)}-artifacts"
    parser = cli.build_parser()
    rows = []
    for argv in commands(device, quick, full):
        args = parser.parse_args([*argv, "--device", device, "--out", str(out)])
        started = time.perf_counter()
        rows += cli.subcommand(argv[0]).run(args)
        print(f"  llmsys-bench {' '.join(argv)}: {time.perf_counter() - started:.0f} s", flush=True)
        if progress:
            progress()
    return rows


# Report tables: (heading, which rows). Per-kernel profile rows stay in the CSV.
SECTIONS = [
    ("End to end (one row per step, then its phases; MFU in `of roofline`)",
     lambda r: r.kernel.startswith("transformer_lm") and r.kernel != "transformer_lm/memory"),
    ("Peak memory", lambda r: r.kernel == "transformer_lm/memory"),
    ("Profiles: measured wall time vs GPU kernel time, per step and phase (the gap is host time)",
     lambda r: r.mode == "profile" and r.provider in ("wall", "gpu", "cpu-ops")),
    ("Attention (batch 8, one head, causal)", lambda r: r.kernel == "attention"),
    ("Precision", lambda r: r.kernel in ("accumulate", "autocast")),
    ("Hugging Face Llama 0.85B", lambda r: r.kernel.startswith("llama/")),
    ("Hugging Face Llama served (prefill, decode, generate)",
     lambda r: r.kernel.startswith("serve/")),
]  # fmt: skip


def report_markdown(rows: list[harness.Row]) -> str:
    """One table per benchmark; says how many rows only the CSV has."""
    parts, shown = [], 0
    for heading, keep in SECTIONS:
        chosen = [r for r in rows if keep(r)]
        if chosen:
            parts.append(f"### {heading}\n\n{results.markdown_table(chosen)}")
            shown += len(chosen)
    if shown < len(rows):
        parts.append(f"{shown} of {len(rows)} rows; the per-kernel profile rows are in the CSV.")
    return "\n\n".join(parts)


def plot(rows: list[harness.Row], path: Path) -> Path:
    """Tokens/s and MFU of each e2e case and provider (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if r.kernel == "transformer_lm" and r.throughput]
    cases = list(dict.fromkeys(f"{r.x} {r.mode} {r.dtype}" for r in steps))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.2 * len(cases)), 8), squeeze=False)
    providers = list(dict.fromkeys(r.provider for r in steps))
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        by_case = {f"{r.x} {r.mode} {r.dtype}": r for r in steps if r.provider == provider}
        xs = [j + i * width for j, case in enumerate(cases) if case in by_case]
        chosen = [by_case[case] for case in cases if case in by_case]
        axes[0][0].bar(xs, [r.throughput for r in chosen], width, label=provider)
        axes[1][0].bar(xs, [(r.roofline_fraction or 0) * 100 for r in chosen], width)
    for ax, label in zip(axes[:, 0], ("tokens / s", "MFU %"), strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, fontsize=7)
        ax.tick_params(axis="x", rotation=20)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    return harness.save_figure(fig, path, "Transformer LM end to end")


def main() -> None:
    parser = harness.sweep_arguments(__doc__.splitlines()[0], RESULTS, "the tiny model only")
    parser.add_argument("--full", action="store_true", help="every size and context (long)")
    args = parser.parse_args()
    if args.replot:
        print(harness.replot(args.replot, plot))
        return
    rows = run(args.device, quick=args.quick, full=args.full)
    csv = harness.write_csv(rows, args.out / f"{harness.device_slug(args.device)}.csv")
    print(f"wrote {csv} and {plot(rows, csv.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
