"""Every measured number typed into a README traces to a CSV its section links (standard library).

The generated results tables are checked against their CSVs by ``tools/readme_tables.py``; this
module checks the numbers typed by hand, in prose and hand-made tables.

A *measured number* is a decimal followed by one of the units in ``UNITS``: times (``ms``,
``us``, ``µs``), time ratios (``x``, this time over the baseline's, lower is faster),
throughputs (``tok/s``, ``tokens/s``, ``GB/s``, ``TB/s``, ``TFLOP/s``) and ``% MFU``. Other
numbers (bare percentages, sizes, counts, the ends of a range such as ``150-210 ms``) are not
checked; a ratio of formulae, not of measurements, is written in words ("2.5 times").

Each measured number must equal, at its printed precision (0.58 matches 0.5812 but not
0.5851), a value of the matching kind in a CSV linked from the same section (heading to next
heading), either as a Markdown link or as a path in backticks:

- a time: a median (``p50``, in the row's ``unit``) or a column named ``*_us`` / ``*_ms``;
- a ratio: a column whose name contains ``ratio``, or a time over the baseline's, which is
  ``1 / speedup_vs_baseline`` in the shared schema;
- a throughput: ``throughput`` where the row's ``throughput_unit`` starts with that unit;
- ``% MFU``: ``100 * roofline_fraction`` of a row whose throughput is in tokens per second;
- any kind: a number with its unit in the row's ``config`` text (``copy bandwidth 3002 GB/s``).

Matching one kind of column of the linked CSVs, not every value of every CSV, is what keeps the
check able to fail (``tools/tests/test_readme_numbers.py`` measures how often a random number
passes). A number is exempt, by a rule one can see in the README, when it is not a measurement
of ours:

- its line cites an external source (``http://`` or ``https://``): a published anchor;
- a target word comes just before it (``TARGET_WORDS``): a bound, not a result;
- it sits in a generated block (``<!-- results:NAME -->``, ``<!-- install -->``), checked by
  the generator, or in an ``<!-- estimate -->`` block: analytic estimates and hardware specs.

A number read off a profiler trace or a log is traced the same way: a CSV summing that output
up is committed beside the others and linked. ``cd tools && python -m llmsys_dev.readme_numbers``
lists the numbers that trace to nothing.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from pathlib import Path

from llmsys_dev.readme_results import _float

# printed unit -> (kind, scale to the kind's base unit: seconds for times)
UNITS: dict[str, tuple[str, float]] = {
    "ms": ("time", 1e-3),
    "us": ("time", 1e-6),
    "µs": ("time", 1e-6),
    "x": ("ratio", 1.0),
    "tok/s": ("tok/s", 1.0),
    "tokens/s": ("tok/s", 1.0),
    "GB/s": ("GB/s", 1.0),
    "TB/s": ("TB/s", 1.0),
    "TFLOP/s": ("TFLOP/s", 1.0),
    "% MFU": ("mfu", 1.0),
}
# "1.3x" takes no space: "16 x 1024" is a shape
NUMBER = re.compile(
    r"(?<![\w.\-/])(\d+(?:,\d{3})*(?:\.\d+)?)"
    r"(x|\s?(?:ms|us|µs|tok/s|tokens/s|GB/s|TB/s|TFLOP/s|% MFU))(?![\w/])"
)
TARGET_WORDS = ("at most", "at least", "under", "target", "≤", "≥")
TARGET_REACH = 24  # characters before a number searched for a target word
EXEMPT_BLOCKS = re.compile(r"results:[\w.-]+|install|estimate")
BLOCK_MARKER = re.compile(r"<!-- (/?)([\w:.-]+) -->")
CSV_LINK = re.compile(r"\]\(([^)\s]+\.csv)\)|`([^`\s]+\.csv)`")
HEADING = re.compile(r"#{1,6} ")


@dataclasses.dataclass(frozen=True)
class Number:
    readme: Path
    line: int
    text: str  # as printed, without the unit
    unit: str
    context: str  # the line, for messages

    @property
    def value(self) -> float:
        return float(self.text.replace(",", ""))

    @property
    def tolerance(self) -> float:
        decimals = len(self.text.split(".")[1]) if "." in self.text else 0
        return 0.5 * 10**-decimals * (1 + 1e-9)

    def __str__(self) -> str:
        where = f"{self.readme.parent.name}/{self.readme.name}:{self.line}"
        return f"{where}: {self.text} {self.unit} | {self.context.strip()[:100]}"


@dataclasses.dataclass
class Section:
    readme: Path
    heading: str
    csvs: list[Path]
    numbers: list[Number]


def sections(readme: Path, root: Path) -> list[Section]:
    """The README cut at its headings, each with the CSVs it links and the numbers to check."""
    found = [Section(readme, "(top)", [], [])]
    fence = False
    block = None
    for number, line in enumerate(readme.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        if HEADING.match(line):
            found.append(Section(readme, line.strip(), [], []))
            continue
        section = found[-1]
        for link in CSV_LINK.finditer(line):
            section.csvs.extend(_resolve(link.group(1) or link.group(2), readme, root))
        marker = BLOCK_MARKER.fullmatch(line.strip())
        if marker and EXEMPT_BLOCKS.fullmatch(marker.group(2)):
            block = None if marker.group(1) else marker.group(2)
            continue
        if block or "http://" in line or "https://" in line:
            continue
        for match in NUMBER.finditer(line):
            before = line[max(0, match.start() - TARGET_REACH) : match.start()]
            if any(word in before for word in TARGET_WORDS):
                continue
            unit = match.group(2).strip()
            section.numbers.append(Number(readme, number, match.group(1), unit, line))
    if fence or block:
        raise ValueError(f"{readme}: a code fence or `<!-- {block} -->` block is never closed")
    return found


def _resolve(target: str, readme: Path, root: Path) -> list[Path]:
    for base in (readme.parent, root):
        path = (base / target).resolve()
        if path.is_file():
            return [path]
    return []


def csv_values(path: Path) -> dict[str, list[float]]:
    """The values a README number of each kind may quote from one CSV (times in seconds)."""
    values: dict[str, list[float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            for kind, value in _row_values(row):
                values.setdefault(kind, []).append(value)
    return values


def _row_values(row: dict[str, str]):
    for column, text in row.items():
        value = _float(text)
        if value is None or column is None:
            continue
        if column.endswith("_us"):
            yield "time", value * 1e-6
        elif column.endswith("_ms"):
            yield "time", value * 1e-3
        elif "ratio" in column:
            yield "ratio", value
    for match in NUMBER.finditer(row.get("config") or ""):
        kind, scale = UNITS[match.group(2).strip()]
        yield kind, float(match.group(1).replace(",", "")) * scale
    p50, unit = _float(row.get("p50")), row.get("unit")
    if p50 is not None and unit in UNITS and UNITS[unit][0] == "time":
        yield "time", p50 * UNITS[unit][1]
    speedup = _float(row.get("speedup_vs_baseline"))
    if speedup:
        yield "ratio", 1 / speedup
    throughput = _float(row.get("throughput"))
    throughput_unit = (row.get("throughput_unit") or "").split(" ")[0]
    if throughput is not None and throughput_unit in UNITS:
        yield UNITS[throughput_unit][0], throughput
    fraction = _float(row.get("roofline_fraction"))
    if fraction is not None and throughput_unit in ("tok/s", "tokens/s"):
        yield "mfu", 100 * fraction


def traces(value: float, tolerance: float, unit: str, values: dict[str, list[float]]) -> bool:
    """Whether ``value`` printed in ``unit`` equals, at ``tolerance``, a value of its kind."""
    kind, scale = UNITS[unit]
    return any(abs(v / scale - value) <= tolerance for v in values.get(kind, ()))


def section_values(section: Section, cache: dict[Path, dict[str, list[float]]]) -> dict:
    """The values of every CSV the section links, by kind."""
    values: dict[str, list[float]] = {}
    for path in section.csvs:
        if path not in cache:
            cache[path] = csv_values(path)
        for kind, kind_values in cache[path].items():
            values.setdefault(kind, []).extend(kind_values)
    return values


def untraced(readmes: list[Path], root: Path) -> list[Number]:
    """The measured numbers of ``readmes`` that no CSV of their section holds."""
    cache: dict[Path, dict[str, list[float]]] = {}
    missing = []
    for readme in readmes:
        for section in sections(readme, root):
            values = section_values(section, cache)
            missing.extend(
                number
                for number in section.numbers
                if not traces(number.value, number.tolerance, number.unit, values)
            )
    return missing


def readmes(root: Path) -> list[Path]:
    return [root / "README.md", *sorted(root.glob("packages/*/README.md"))]


if __name__ == "__main__":
    from llmsys_dev.workspace import ROOT

    missing = untraced(readmes(ROOT), ROOT)
    print(*missing, f"{len(missing)} number(s) trace to no CSV linked in their section", sep="\n")
