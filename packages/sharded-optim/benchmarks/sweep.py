"""ZeRO-1 sweep: ``memory_and_step.py`` on 2 ranks through torchrun, its CSV read back.

On a host with at least 2 GPUs: the XL case (context 512, batch 4 per GPU, bf16 autocast), one
rank per GPU over NCCL. On a CPU: the tiny model on 2 gloo ranks, a smoke test whose numbers say
nothing. With one GPU there is nothing to shard across: the sweep returns no rows and
:func:`skipped` says why. Writes ``results/<gpu>.csv`` and ``results/<gpu>.png``; the ``bench``
main job calls :func:`run`. The environment (``NCCL_*`` included) passes to the ranks unchanged.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import llmsys.bench_harness as harness

memory_and_step = harness.load_beside(__file__, "memory_and_step")

RESULTS = Path(__file__).parent / "results"
RANKS = 2
SMOKE = ["--size", "tiny", "--context-length", "64", "--batch-size", "2", "--steps", "3",
         "--warmup", "1"]  # fmt: skip


def skipped(device: str) -> list[str]:
    """What this sweep leaves out on ``device``, and why."""
    if device != "cuda":
        return [
            "the XL case needs 2 GPUs: on CPU the tiny model runs on 2 gloo ranks as a smoke "
            "test (times and memory there say nothing)"
        ]
    if torch.cuda.device_count() < RANKS:
        return [f"needs {RANKS} GPUs to shard across, found {torch.cuda.device_count()}"]
    return []


def arguments(device: str, quick: bool, out: Path) -> list[str]:
    """The benchmark's arguments on ``device``."""
    if device != "cuda":
        args = SMOKE
    elif quick:
        args = ["--steps", "3", "--warmup", "1"]
    else:
        args = []  # the XL defaults
    return ["--out", str(out), *args]


def run(device: str = "cuda", *, quick: bool = False, progress=None) -> list[harness.Row]:
    """Run the benchmark on 2 ranks and return its rows (none with fewer than 2 GPUs)."""
    if device == "cuda" and torch.cuda.device_count() < RANKS:
        return []
    with tempfile.TemporaryDirectory() as out:
        script = Path(memory_and_step.__file__)
        harness.torchrun(script, RANKS, arguments(device, quick, Path(out)))
        rows = harness.read_rows(Path(out) / f"{harness.device_slug(device)}.csv")
    if progress:
        progress()
    return rows


def plot(rows: list[harness.Row], path: Path) -> Path:
    return memory_and_step.plot(rows, path)


def main() -> None:
    parser = harness.sweep_arguments(__doc__.splitlines()[0], RESULTS, "fewer steps")
    args = parser.parse_args()
    if args.replot:
        print(harness.replot(args.replot, plot))
        return
    for note in skipped(args.device):
        print(f"skipped: {note}")
    rows = run(args.device, quick=args.quick)
    if rows:
        csv = harness.write_csv(rows, args.out / f"{harness.device_slug(args.device)}.csv")
        png = harness.plot_or_say_why_not(plot, rows, csv.with_suffix(".png"))
        print(harness.markdown_table(rows))
        print(f"wrote {csv} and {png}" if png else f"wrote {csv}")


if __name__ == "__main__":
    main()
