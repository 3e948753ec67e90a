"""Every ratio in a generated table reads one way, and its column header says which: the README
results tables (tools/llmsys_dev/readme_results.py) and the report's tables (the harness's
markdown_table, which the main job and llmsys-bench write)."""

import random
import re

import readme_tables

from llmsys.bench_harness import results
from llmsys_dev import readme_results

RATIO = re.compile(r"\d\.\d+x|\(\d+\.\d+\)")  # 0.80x, or a time's (0.97) in brackets
DIRECTION = ("lower is faster", "higher is faster")


def tables(markdown: str) -> list[list[list[str]]]:
    """Each Markdown table of ``markdown`` as rows of cells, the header row first."""
    found, current = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set("-:"):  # not the rule under the header
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def undirected_ratio_columns(markdown: str) -> list[str]:
    """Headers of the columns that hold a ratio but do not name its direction."""
    bad = []
    for head, *body in tables(markdown):
        for i, name in enumerate(head):
            holds_ratio = any(i < len(row) and RATIO.search(row[i]) for row in body)
            if holds_ratio and not any(d in name for d in DIRECTION):
                bad.append(name)
    return bad


def test_the_check_finds_a_ratio_column_without_a_direction():
    assert undirected_ratio_columns("| a | vs baseline |\n|---|---:|\n| x | 1.25x |\n") == [
        "vs baseline"
    ]
    assert undirected_ratio_columns("| a | ours |\n|---|---:|\n| x | 3 ms (0.80) |\n") == ["ours"]


def generated_blocks(text: str) -> list[str]:
    """The generated results blocks of a README (its hand-written tables are prose)."""
    return re.findall(r"<!-- results:([^ ]+) -->\n(.*?)<!-- /results:\1 -->", text, re.S)


def test_every_generated_readme_ratio_column_names_its_direction():
    blocks = 0
    for path, text in readme_tables.generate().items():
        for name, block in generated_blocks(text):
            blocks += 1
            assert undirected_ratio_columns(block) == [], (path, name)
    assert blocks >= len(readme_results.TABLES)  # the root's and the host-cost table too


def test_every_readme_table_block_names_its_direction():
    root = readme_tables.ROOT
    for name, table in readme_results.TABLES.items():
        assert undirected_ratio_columns(readme_results.package_table(table, root)) == [], name


def test_the_report_shows_time_over_baseline_with_its_direction():
    rng = random.Random()
    base = rng.uniform(1, 10)
    rows = [
        results.Row(kernel="k", provider=p, mode="fwd", x="8", dtype="bf16", p50=t, p20=t, p80=t,
                    speedup_vs_baseline=base / t)
        for p, t in (("eager", base), ("ours", rng.uniform(1, 10)))
    ]  # fmt: skip
    markdown = results.markdown_table(rows)
    assert undirected_ratio_columns(markdown) == []
    head, _, ours = tables(markdown)[0]
    column = head.index(results.TIME_RATIO_HEADER)
    assert ours[column] == f"{rows[1].p50 / base:.2f}x"  # ours' time over eager's
