"""Compare a pytest-benchmark JSON run against a committed baseline.

A benchmark whose median is slower than the baseline's by more than the threshold (10% by
default) fails the comparison; faster or new benchmarks pass. A missing baseline file is a
notice, not a failure (a GPU model nobody has recorded yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path


@dataclasses.dataclass
class Comparison:
    name: str
    baseline: float | None  # median seconds
    new: float | None

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.new is None:
            return None
        return self.new / self.baseline

    def status(self, threshold: float) -> str:
        if self.new is None:
            return "missing"  # in the baseline, not in this run
        if self.baseline is None:
            return "new"
        return "slower" if self.ratio > 1 + threshold else "ok"


def medians(path: str | Path) -> dict[str, float]:
    """Median seconds of each benchmark in a pytest-benchmark JSON file, by full name."""
    data = json.loads(Path(path).read_text())
    return {b["fullname"]: b["stats"]["median"] for b in data["benchmarks"]}


def compare(new: dict[str, float], baseline: dict[str, float]) -> list[Comparison]:
    names = sorted(set(new) | set(baseline))
    return [Comparison(name, baseline.get(name), new.get(name)) for name in names]


def format_table(results: list[Comparison], threshold: float) -> str:
    lines = [f"{'benchmark':70} {'baseline':>11} {'new':>11} {'ratio':>6}  status"]
    for r in results:
        base = f"{r.baseline * 1e3:9.4f}ms" if r.baseline is not None else "-"
        new = f"{r.new * 1e3:9.4f}ms" if r.new is not None else "-"
        ratio = f"{r.ratio:6.3f}" if r.ratio is not None else "-"
        lines.append(f"{r.name[-70:]:70} {base:>11} {new:>11} {ratio:>6}  {r.status(threshold)}")
    return "\n".join(lines)


def compare_files(new: str | Path, baseline: str | Path, threshold: float = 0.10) -> bool:
    """Print the comparison; True when nothing regressed past the threshold."""
    if not Path(baseline).exists():
        print(f"notice: no baseline at {baseline}; nothing to compare (record one first)")
        return True
    results = compare(medians(new), medians(baseline))
    print(format_table(results, threshold))
    slower = [r for r in results if r.status(threshold) == "slower"]
    for r in slower:
        print(f"REGRESSION: {r.name} is {(r.ratio - 1) * 100:.1f}% slower than its baseline")
    return not slower


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("new", type=Path, help="pytest-benchmark JSON of the new run")
    parser.add_argument("baseline", type=Path, help="committed baseline JSON")
    parser.add_argument("--threshold", type=float, default=0.10, help="allowed slow-down (0.10)")
    args = parser.parse_args(argv)
    return 0 if compare_files(args.new, args.baseline, args.threshold) else 1


if __name__ == "__main__":
    sys.exit(main())
