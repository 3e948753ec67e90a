"""Every measured number typed into a README traces to a CSV its section links
(``llmsys_dev/readme_numbers.py``), and the check can fail: a fabricated number is caught, and a
random number of a README's own format passes in few of its sections' CSVs."""

import random

import pytest

from llmsys_dev import readme_numbers
from llmsys_dev.workspace import ROOT

HEADER = "kernel,provider,x,p50,unit,throughput,throughput_unit,roofline_fraction,"
HEADER += "speedup_vs_baseline,config\n"
ROWS = [
    "step,ours,b4,0.5812,ms,51234.0,tok/s,0.4321,1.25,copy bandwidth 3002 GB/s\n",
    "step,eager,b4,0.7265,ms,40987.0,tok/s,0.3457,1.0,\n",
]


def _write(tmp_path, readme_text: str):
    (tmp_path / "results.csv").write_text(HEADER + "".join(ROWS))
    readme = tmp_path / "README.md"
    readme.write_text(readme_text)
    return readme


def _untraced(tmp_path, readme_text: str) -> list[str]:
    readme = _write(tmp_path, readme_text)
    return [f"{n.text} {n.unit}" for n in readme_numbers.untraced([readme], tmp_path)]


def test_every_readme_number_traces_to_a_csv_its_section_links():
    missing = readme_numbers.untraced(readme_numbers.readmes(ROOT), ROOT)
    assert missing == [], "numbers with no CSV row behind them:\n" + "\n".join(map(str, missing))


def test_a_number_of_the_linked_csv_passes_at_its_printed_precision(tmp_path):
    text = (
        "## Results\n\nFrom [the CSV](results.csv): 0.58 ms, 581.2 us, 0.80x, 51,234 tok/s, "
        "43% MFU, 3002 GB/s; 0.73 ms for eager.\n"
    )
    assert _untraced(tmp_path, text) == []


def test_a_fabricated_or_misrounded_number_fails(tmp_path):
    text = (
        "## Results\n\nFrom [the CSV](results.csv): 0.59 ms (0.5812 rounds to 0.58), "
        "0.81x, 1.25x (a speed-up, not a time ratio), 51,300 tok/s, 44% MFU.\n"
    )
    assert _untraced(tmp_path, text) == ["0.59 ms", "0.81 x", "1.25 x", "51,300 tok/s", "44 % MFU"]


def test_a_value_of_another_kind_does_not_trace(tmp_path):
    # 0.4321 is a roofline fraction and 1.0 a speed-up: neither is a time
    assert _untraced(tmp_path, "[CSV](results.csv) 0.4321 ms and 1.0 ms\n") == [
        "0.4321 ms",
        "1.0 ms",
    ]


def test_the_csv_must_be_linked_in_the_same_section(tmp_path):
    text = "## One\n\n[CSV](results.csv)\n\n## Two\n\nours takes 0.58 ms\n"
    assert _untraced(tmp_path, text) == ["0.58 ms"]


def test_exemptions_are_visible_rules(tmp_path):
    text = (
        "## Results\n\n"
        "The paper reports 9.99 ms (https://example.org/paper).\n"
        "The target is at most 0.42x, and under 7.7 ms.\n"
        "<!-- estimate -->\n1.23 us of HBM time at 3.35 TB/s.\n<!-- /estimate -->\n"
        "<!-- results:x -->\n| 8.88 ms |\n<!-- /results:x -->\n"
        "```\nllmsys-bench --budget 5.5 ms\n```\n"
        "A shape of 16 x 1024 and 7x3x5 is no ratio. But ours takes 6.66 ms.\n"
    )
    assert _untraced(tmp_path, text) == ["6.66 ms"]


def test_an_unclosed_block_is_refused(tmp_path):
    readme = _write(tmp_path, "<!-- estimate -->\n1.0 ms\n")
    with pytest.raises(ValueError, match="estimate"):
        readme_numbers.sections(readme, tmp_path)


def test_a_random_number_in_a_readmes_format_rarely_passes_its_sections_csvs():
    """A number of the same unit and precision, within a factor 2 of each number of the
    READMEs, checked against that number's section: few pass (about 13% when written)."""
    rng = random.Random()
    cache: dict = {}
    tried = passed = 0
    for readme in readme_numbers.readmes(ROOT):
        for section in readme_numbers.sections(readme, ROOT):
            values = readme_numbers.section_values(section, cache)
            for number in section.numbers:
                decimals = len(number.text.split(".")[1]) if "." in number.text else 0
                for _ in range(20):
                    fake = round(number.value * 2 ** rng.uniform(-1, 1), decimals)
                    tried += 1
                    passed += readme_numbers.traces(fake, number.tolerance, number.unit, values)
    assert tried >= 400, "the READMEs hold fewer measured numbers than expected"
    assert passed / tried < 0.25, f"{passed} of {tried} random numbers passed"
