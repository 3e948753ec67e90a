"""The main job: run every package's benchmark sweep that applies here and write one report.

Each package plugs in by providing ``benchmarks/sweep.py`` with
``run(device, *, quick, progress) -> list[harness.Row]`` and, optionally,
``skipped(device) -> list[str]`` (what it leaves out here, and why),
``plot(rows, path)`` and ``report_rows(rows) -> list[harness.Row]`` (the rows the report's
table shows; its CSV keeps them all) or ``report_markdown(rows) -> str`` (the section's body,
for a package whose rows read better as several tables). On a GPU the full sweeps run; on a
CPU-only machine a small default (Triton under the interpreter, tiny sizes) that still
exercises every package.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .workspace import select

if TYPE_CHECKING:
    import llmsys.bench_harness as harness

ROOT = Path(__file__).resolve().parents[2]


def load_sweep(package_path: Path):
    path = package_path / "benchmarks" / "sweep.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"sweep_{package_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as an import would: dataclasses (and pickling) look the
    # module up by name while the file executes.
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]  # as a failed import leaves nothing behind
        raise
    return module


def section_body(sweep, rows: list[harness.Row], csv_name: str) -> str:
    """The tables of one package's section, as its sweep chooses to show its rows, then the
    roofline's prediction against them (rows measured on a GPU the model knows)."""
    from llmsys.bench_harness import table_section
    from llmsys.profiling.infra import roofline_check

    if hasattr(sweep, "report_markdown"):
        body = sweep.report_markdown(rows)
    else:
        # A selection that keeps nothing (a CPU run's tiny cases) shows every row.
        shown = (sweep.report_rows(rows) if hasattr(sweep, "report_rows") else rows) or rows
        body = table_section(rows, shown, csv_name)
    checks = roofline_check.check_rows(rows)
    if checks:
        body += (
            "\n\n#### Measured against the roofline's prediction (`llmsys-roofline check`)\n\n"
            + roofline_check.summary_markdown(checks)
        )
    return body


def committed_gpu_links(swept: list, out: Path) -> str:
    """A section linking the committed GPU results (``results/<gpu>.csv``, its plot, and the
    composed ``reports/<gpu>/REPORT.md``) of each (package, sweep) in ``swept``: a CPU-only
    run's report points to them instead of copying thousands of lines."""
    lines, gpus = [], set()
    for package, _ in swept:
        results_dir = package.path / "benchmarks" / "results"
        links = []
        for path in sorted(results_dir.glob("*.csv")):
            if not re.fullmatch(r"[a-z]+\d+", path.stem):  # h100.csv, not h100-llama.csv
                continue
            gpus.add(path.stem)
            link = f"[`{path.stem}.csv`]({os.path.relpath(path, out)})"
            plot = path.with_suffix(".png")
            if plot.exists():
                link += f" ([plot]({os.path.relpath(plot, out)}))"
            links.append(link)
        readme = package.path / "README.md"
        if links:
            table = f"[README results]({os.path.relpath(readme, out)}#results)"
            lines.append(f"- {package.name}: {', '.join(links)}; {table}")
    reports = [
        f"[`reports/{gpu}/REPORT.md`]({os.path.relpath(ROOT / 'reports' / gpu / 'REPORT.md', out)})"
        for gpu in sorted(gpus)
        if (ROOT / "reports" / gpu / "REPORT.md").exists()
    ]
    if not lines:
        return ""
    return (
        "## Committed GPU results (measured elsewhere, not on this machine)\n\n"
        + (f"Composed reports: {', '.join(reports)}.\n\n" if reports else "")
        + "\n".join(lines)
        + "\n"
    )


def _flush() -> None:
    for stream in {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}:
        if stream is not None:
            stream.flush()


@contextlib.contextmanager
def output_to(path: Path):
    """Send whatever is written to stdout and stderr meanwhile (by Python, by C++ such as
    torch's ``USDT`` profiler lines, or by child processes) to ``path`` instead."""
    _flush()
    saved = os.dup(1), os.dup(2)
    with path.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            _flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def merge_into_committed(rows: list, path: Path) -> Path:
    """Write ``rows`` into the package's committed ``results/<gpu>.csv``: a row of this run
    replaces the committed row of the same (kernel, provider, mode, case, dtype); the others
    stay (a default run leaves the ``--full`` rows as they were). ``python
    tools/readme_tables.py`` then regenerates the READMEs from it."""
    import llmsys.bench_harness as harness

    def key(r):
        return (r.kernel, r.provider, r.mode, r.x, r.dtype)

    fresh = {key(r) for r in rows}
    kept = [r for r in harness.read_rows(path) if key(r) not in fresh] if path.exists() else []
    return harness.write_csv([*rows, *kept], path)


def _takes_full(sweep) -> bool:
    import inspect

    return "full" in inspect.signature(sweep.run).parameters


def _committed(package, slug: str) -> list[dict]:
    import llmsys.bench_harness as harness

    path = package.path / "benchmarks" / "results" / f"{slug}.csv"
    return harness.read_csv(path) if path.exists() else []


def build_parser() -> argparse.ArgumentParser:
    """The main job's command line (standard library only: ``--help`` needs no torch)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=ROOT / "reports", help="report folder")
    parser.add_argument("--package", action="append", help="only these packages (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smallest cases only")
    parser.add_argument(
        "--full",
        action="store_true",
        help="the long sweeps too: flash-attn2's whole grid and the "
        "profiling package's warm-up, memory, profiles, attention sweep and Hugging Face Llama",
    )
    parser.add_argument(
        "--from-results",
        metavar="GPU",
        help="run nothing: compose the report from each package's committed "
        "benchmarks/results/<GPU>.csv and plot, linked (e.g. h100)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch
    from tqdm import tqdm

    import llmsys.bench_harness as harness

    from . import device as _device  # noqa: F401  (the interpreter without a GPU, before Triton)

    device = "cuda" if torch.cuda.is_available() and not args.from_results else "cpu"
    if device == "cpu" and not args.from_results and os.environ.get("TRITON_INTERPRET") != "1":
        print("note: no GPU and TRITON_INTERPRET is not 1; Triton rows use the eager fallback")
    slug = args.from_results or harness.device_slug(device)
    out = args.out / slug
    out.mkdir(parents=True, exist_ok=True)
    packages = select(args.package)
    sections, skipped, swept, timings = [], [], [], []
    started = time.perf_counter()
    # The progress bars and one line per package go to the terminal; each sweep's own output
    # (profiler tables, torch's USDT lines, worker processes) to <package>.log beside the report.
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    with tqdm(total=len(packages), desc="packages", unit="pkg", file=terminal) as bar:
        for package in packages:
            bar.set_postfix_str(package.name)
            sweep = load_sweep(package.path)
            if sweep is None:
                skipped.append(f"{package.name}: no benchmarks/sweep.py")
                bar.update()
                continue
            if args.from_results:
                committed = package.path / "benchmarks" / "results" / f"{slug}.csv"
                if not committed.exists():
                    skipped.append(f"{package.name}: no committed results/{slug}.csv")
                    bar.update()
                    continue
                rows = [harness.Row.from_dict(r) for r in harness.read_csv(committed)]
            else:
                part_started = time.perf_counter()
                log = out / f"{package.name}.log"
                log.unlink(missing_ok=True)
                with (
                    tqdm(
                        desc=f"  {package.name}", unit="case", leave=False, file=terminal
                    ) as inner,
                    output_to(log),
                ):
                    quick = args.quick or device == "cpu"
                    extra = {"full": True} if args.full and _takes_full(sweep) else {}
                    rows = sweep.run(device, quick=quick, progress=inner.update, **extra)
                part = time.perf_counter() - part_started
                timings.append((package.name, part))
                tqdm.write(
                    f"{package.name}: {part:.0f} s "
                    f"(main job so far {time.perf_counter() - started:.0f} s; output: {log})",
                    file=terminal,
                )
                if device == "cuda" and rows:
                    committed = package.path / "benchmarks" / "results" / f"{slug}.csv"
                    tqdm.write(f"  updated {merge_into_committed(rows, committed)}", file=terminal)
            if args.from_results:  # link the committed files instead of copying them
                csv_path, png = committed, committed.with_suffix(".png")
            else:
                csv_path, png = harness.write_csv(rows, out / f"{package.name}.csv"), None
            if hasattr(sweep, "plot") and rows and not (png and png.exists()):
                png = sweep.plot(rows, out / f"{package.name}.png")
            csv_name = os.path.relpath(csv_path, out)
            picture = f"\n![{package.name}]({os.path.relpath(png, out)})\n" if png else ""
            notes = (
                sweep.skipped(device) if hasattr(sweep, "skipped") and not args.from_results else []
            )
            skipped += [f"{package.name}: {note}" for note in notes]
            swept.append((package, sweep))
            table = section_body(sweep, rows, csv_name)
            log_link = (
                ""
                if args.from_results
                else f"; its output: [`{package.name}.log`]({package.name}.log)"
            )
            sections.append(
                f"## {package.name}\n\nCSV: [`{csv_name}`]({csv_name}){log_link}\n"
                f"{picture}\n{table}\n"
            )
            bar.update()
    if device == "cpu" and not args.from_results:
        links = committed_gpu_links(swept, out)
        sections += [links] if links else []
    elapsed = time.perf_counter() - started
    measured_on = rows_device = harness.device_name(device)
    if args.from_results:
        rows_device = ", ".join(sorted({r["gpu"] for p in packages for r in _committed(p, slug)}))
        measured_on = f"{rows_device} (composed from the committed results CSVs)"
    header = (
        f"# llmsys benchmark report\n\nDevice: {measured_on} | "
        f"composed with torch {torch.__version__} | {harness.timestamp()} | {elapsed:.0f} s\n\n"
        "Times are medians (p50); `time / baseline` is this row's time over the baseline "
        "provider's (lower is faster), as in the plots and every README; the roofline is the "
        "measured copy bandwidth for memory-bound kernels "
        "and the measured matmul rate for compute-bound ones, except in the profiling package, "
        "whose `of roofline` is MFU or attention TFLOP/s over the GPU's datasheet peak (each "
        "row's config names it).\n"
    )
    if device == "cpu" and not args.from_results:
        header += (
            "\n> CPU-only machine: the Triton kernels ran under the interpreter at tiny sizes. "
            "These rows show that every package's benchmark runs; they say nothing about speed. "
            "The GPU results committed in the repository are linked at the end.\n"
        )
    skipped_text = "\n## Skipped here\n\n" + "\n".join(f"- {s}" for s in skipped) + "\n"
    report = out / "REPORT.md"
    timing_text = ""
    if timings:
        timing_text = "\n## Where the time went\n\n| part | seconds |\n|---|---:|\n" + "".join(
            f"| {name} | {seconds:.0f} |\n" for name, seconds in timings
        )
    report.write_text(
        header + "\n" + "\n".join(sections) + (skipped_text if skipped else "") + timing_text
    )
    print(f"wrote {report}")
    for name, seconds in timings:
        print(f"  {name:16} {seconds:6.0f} s")
    print(f"main job: {elapsed:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
