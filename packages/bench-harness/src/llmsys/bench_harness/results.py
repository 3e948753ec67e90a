"""The one tidy results schema every llmsys benchmark writes, and its Markdown table.

Each row of a results CSV is one (kernel, provider, mode, case): its p20/p50/p80 times, the
throughput they imply and that throughput as a fraction of a ceiling (copy bandwidth, the
matmul rate, or the GPU's peak FLOP/s for model FLOPs utilization). ``mean``, ``std`` and
``memory_gib`` are filled by benchmarks that report them (the end-to-end model runs).
``llmsys.bench_harness`` re-exports it, beside the timer and row builder of ``harness``.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import math
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

CSV_FIELDS = [
    "kernel",
    "provider",
    "mode",
    "x",
    "dtype",
    "p20",
    "p50",
    "p80",
    "unit",
    "throughput",
    "throughput_unit",
    "roofline_fraction",
    "speedup_vs_baseline",
    "config",
    "gpu",
    "version",
    "timestamp",
    "mean",
    "std",
    "memory_gib",
]


@dataclasses.dataclass
class Row:
    kernel: str
    provider: str
    mode: str
    x: str
    dtype: str
    p20: float
    p50: float
    p80: float
    unit: str = "ms"
    throughput: float | None = None
    throughput_unit: str = ""
    roofline_fraction: float | None = None
    speedup_vs_baseline: float | None = None
    config: str = ""
    gpu: str = ""
    version: str = ""
    timestamp: str = ""
    mean: float | None = None
    std: float | None = None
    memory_gib: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Row:
        """A row back from a CSV record: numbers parsed, empty or missing cells as None."""
        parsed: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = values.get(field.name) or ""
            if field.type in ("float", "float | None"):
                parsed[field.name] = float(raw) if raw != "" else None
            else:
                parsed[field.name] = raw
        return cls(**parsed)


def device_name(device: str | torch.device = "cuda") -> str:
    """Human name of the device: 'NVIDIA H100 80GB HBM3' or 'cpu'."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def device_slug(device: str | torch.device = "cuda") -> str:
    """File-name form of the device: 'h100', 'h200', 'a100', or 'cpu'."""
    name = device_name(device).lower()
    match = re.search(r"\b([abhl]\d{2,3}|b200|gb200)\b", name)
    if match:
        return match.group(1)
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def timestamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(p20, p50, p80) of ``values`` (all three the value itself when there is one)."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return q[1], statistics.median(values), q[7]


def write_csv(rows: Iterable[Row], path: str | Path) -> Path:
    """Write rows to ``path`` with the shared schema; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(row.as_dict())
    return path


def read_csv(path: str | Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def read_rows(path: str | Path) -> list[Row]:
    return [Row.from_dict(record) for record in read_csv(path)]


def _number(value: float | None, fmt: str) -> str:
    return "" if value is None or math.isnan(value) else format(value, fmt)


def _readable(value: float) -> str:
    """12,345 for large numbers (tokens/s), 4 significant digits otherwise (TB/s, TFLOP/s)."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


# Every ratio of times in a table reads one way: this row's time over the baseline's.
TIME_RATIO_HEADER = "time / baseline, lower is faster"


def _time_ratio(speedup: float | None) -> str:
    """The row's time over the baseline's, from the CSV's ``speedup_vs_baseline`` (its inverse)."""
    if not speedup or math.isnan(speedup):
        return ""
    return f"{1 / speedup:.2f}x"


def _timed(row: Row) -> bool:
    return row.p50 is not None and not math.isnan(row.p50)


def _time(value: float) -> str:
    """Four significant digits, never in scientific notation: ``12345``, not ``1.234e+04``."""
    short = f"{value:.4g}"
    if "e" not in short or not math.isfinite(value):
        return short
    exponent = math.floor(math.log10(abs(value)))
    return f"{value:.{max(3 - exponent, 0)}f}"


def markdown_table(rows: list[Row]) -> str:
    """One line per row; the p20-p80 range after p50 where rows report a spread (``std``: the
    end-to-end runs, whose derived numbers all come from p50), and a memory column where rows
    carry it (in MiB when every value is under 1 GiB, so small models do not all read
    0.01-0.05 GiB). Rows with
    no time at all (values such as a sum, in ``throughput``) get ``value`` and ``config`` columns
    instead, the value at 7 significant digits."""
    if rows and not any(_timed(r) for r in rows):
        return _values_table(rows)
    memory = [
        r.memory_gib for r in rows if r.memory_gib is not None and not math.isnan(r.memory_gib)
    ]
    in_mib = bool(memory) and max(memory) < 1
    head = (
        "| kernel | mode | dtype | case | provider | p50 | throughput | of roofline "
        f"| {TIME_RATIO_HEADER} |"
    )
    rule = "|---|---|---|---|---|---:|---:|---:|---:|"
    lines = [
        head + ((" memory MiB |" if in_mib else " memory GiB |") if memory else ""),
        rule + ("---:|" if memory else ""),
    ]
    for r in rows:
        p50 = f"{r.p50:.4g} {r.unit}" if _timed(r) else ""
        if r.std is not None and p50:
            p50 = f"{_time(r.p50)} {r.unit} (p20-p80 {_time(r.p20)}-{_time(r.p80)})"
        throughput = f"{_readable(r.throughput)} {r.throughput_unit}" if r.throughput else ""
        line = (
            f"| {r.kernel} | {r.mode} | {r.dtype} | {r.x} | {r.provider} | {p50 or r.config} | "
            f"{throughput} | {_number(r.roofline_fraction, '.0%')} | "
            f"{_time_ratio(r.speedup_vs_baseline)} |"
        )
        if memory:
            mib = None if r.memory_gib is None else r.memory_gib * 1024
            line += f" {_number(mib, '.1f') if in_mib else _number(r.memory_gib, '.2f')} |"
        lines.append(line)
    return "\n".join(lines)


def _values_table(rows: list[Row]) -> str:
    lines = [
        "| kernel | mode | dtype | case | provider | value | config |",
        "|---|---|---|---|---|---:|---|",
    ]
    for r in rows:
        unit = "" if r.throughput_unit in ("", "value") else f" {r.throughput_unit}"
        value = "" if r.throughput is None else f"{r.throughput:.7g}{unit}"
        lines.append(
            f"| {r.kernel} | {r.mode} | {r.dtype} | {r.x} | {r.provider} | {value} | {r.config} |"
        )
    return "\n".join(lines)


def table_section(rows: list[Row], shown: list[Row], csv_name: str) -> str:
    """The Markdown table of ``shown``, saying how many of ``rows`` are only in the CSV."""
    table = markdown_table(shown)
    if len(shown) < len(rows):
        table += f"\n\n{len(shown)} of {len(rows)} rows; all of them are in `{csv_name}`."
    return table
