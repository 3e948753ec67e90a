"""The main job: run every package's benchmark sweep that applies here and write one report.

Each package plugs in by providing ``benchmarks/sweep.py`` with
``run(device, *, quick, progress) -> list[harness.Row]`` and, optionally,
``skipped(device) -> list[str]`` (what it leaves out here, and why) and
``plot(rows, path)``. On a GPU the full sweeps run; on a CPU-only machine a small default
(Triton under the interpreter, tiny sizes) that still exercises every package.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from . import harness

ROOT = Path(__file__).resolve().parents[2]


def load_sweep(package_path: Path):
    path = package_path / "benchmarks" / "sweep.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"sweep_{package_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def markdown_table(rows: list[harness.Row]) -> str:
    lines = [
        "| kernel | mode | dtype | case | provider | p50 | throughput | of roofline "
        "| vs baseline |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        throughput = f"{r.throughput:.2f} {r.throughput_unit}" if r.throughput else ""
        fraction = f"{r.roofline_fraction:.0%}" if r.roofline_fraction else ""
        speedup = f"{r.speedup_vs_baseline:.2f}x" if r.speedup_vs_baseline else ""
        lines.append(
            f"| {r.kernel} | {r.mode} | {r.dtype} | {r.x} | {r.provider} | {r.p50:.4g} {r.unit} | "
            f"{throughput} | {fraction} | {speedup} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reports", help="report folder")
    parser.add_argument("--package", action="append", help="only these packages (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smallest cases only")
    args = parser.parse_args(argv)

    import torch
    from tqdm import tqdm

    sys.path.insert(0, str(ROOT / "tools"))
    from llmsys_dev.workspace import select

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("note: no GPU and TRITON_INTERPRET is not 1; Triton rows use the eager fallback")
    slug = harness.device_slug(device)
    out = args.out / slug
    out.mkdir(parents=True, exist_ok=True)
    packages = select(args.package)
    sections, skipped = [], []
    started = time.perf_counter()
    with tqdm(total=len(packages), desc="packages", unit="pkg") as bar:
        for package in packages:
            bar.set_postfix_str(package.name)
            sweep = load_sweep(package.path)
            if sweep is None:
                skipped.append(f"{package.name}: no benchmarks/sweep.py")
                bar.update()
                continue
            with tqdm(desc=f"  {package.name}", unit="case", leave=False) as inner:
                rows = sweep.run(device, quick=args.quick or device == "cpu", progress=inner.update)
            csv_path = harness.write_csv(rows, out / f"{package.name}.csv")
            picture = ""
            if hasattr(sweep, "plot") and rows:
                png = sweep.plot(rows, out / f"{package.name}.png")
                picture = f"\n![{package.name}]({png.name})\n"
            notes = sweep.skipped(device) if hasattr(sweep, "skipped") else []
            skipped += [f"{package.name}: {note}" for note in notes]
            sections.append(
                f"## {package.name}\n\nCSV: `{csv_path.name}`\n{picture}\n{markdown_table(rows)}\n"
            )
            bar.update()
    elapsed = time.perf_counter() - started
    header = (
        f"# llmsys benchmark report\n\nDevice: {harness.device_name(device)} | "
        f"torch {torch.__version__} | {harness.timestamp()} | {elapsed:.0f} s\n\n"
        "Times are medians (p50); `vs baseline` is the baseline provider's time over this one's "
        "(higher is faster); the roofline is the measured copy bandwidth.\n"
    )
    if device == "cpu":
        header += (
            "\n> CPU-only machine: the Triton kernels ran under the interpreter at tiny sizes. "
            "These rows show that every package's benchmark runs; they say nothing about speed.\n"
        )
    skipped_text = "\n## Skipped here\n\n" + "\n".join(f"- {s}" for s in skipped) + "\n"
    report = out / "REPORT.md"
    report.write_text(header + "\n" + "\n".join(sections) + (skipped_text if skipped else ""))
    print(f"wrote {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
