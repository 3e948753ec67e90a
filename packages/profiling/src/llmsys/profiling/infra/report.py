"""Compose results CSVs (any llmsys package's, or llmsys-bench's own) into one Markdown report.

    llmsys-bench report llmsys-bench-results/ packages/*/benchmarks/results/ --out REPORT.md

Each CSV becomes a section: its table (``results.markdown_table``) and, when a PNG of the same
name lies beside it, the plot. The repository's main job (``python tools/bench.py``) runs every
package's sweep and composes its report with the same table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmsys.bench_harness import results

HELP = "compose results CSVs (files or folders) into one Markdown report with tables and plots"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", type=Path, help="CSV files or folders holding them")
    parser.add_argument("--out", type=Path, default=Path("REPORT.md"), help="the Markdown file")
    parser.add_argument("--title", default="llmsys benchmark report")


table_section = results.table_section  # the main job's report uses the same table


def csv_files(inputs: list[Path]) -> list[Path]:
    found = []
    for path in inputs:
        if path.is_dir():
            found += sorted(path.glob("*.csv"))
        elif path.suffix == ".csv" and path.exists():
            found.append(path)
        else:
            raise SystemExit(f"report: {path} is neither a folder nor an existing .csv file")
    return found


def compose(csvs: list[Path], out: Path, title: str) -> Path:
    sections = []
    for path in csvs:
        rows = results.read_rows(path)
        plot = path.with_suffix(".png")
        picture = f"\n![{path.stem}]({_relative(plot, out.parent)})\n" if plot.exists() else ""
        gpus = ", ".join(sorted({r.gpu for r in rows if r.gpu})) or "unknown device"
        sections.append(
            f"## {path.stem}\n\n`{path}` ({len(rows)} rows, {gpus})\n{picture}\n"
            f"{table_section(rows, rows, path.name)}\n"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {title}\n\n" + "\n".join(sections))
    return out


def _relative(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve())


def run(args: argparse.Namespace) -> list[results.Row]:
    csvs = csv_files(args.inputs)
    if not csvs:
        raise SystemExit(f"report: no CSV files in {[str(p) for p in args.inputs]}")
    path = compose(csvs, args.out, args.title)
    print(f"wrote {path} ({len(csvs)} CSV files)")
    return []
