"""The READMEs' generated parts match what `python tools/readme_tables.py` writes from the
committed CSVs and pyproject files, so a README number has one source."""

import re

import readme_tables

from llmsys_dev import readme_install, readme_results, readme_roofline
from llmsys_dev.isolation import install_command
from llmsys_dev.workspace import ROOT, discover


def test_readmes_match_the_generator():
    stale = [
        str(path.relative_to(ROOT))
        for path, text in readme_tables.generate().items()
        if path.read_text() != text
    ]
    assert stale == [], "run `python tools/readme_tables.py` and commit: " + ", ".join(stale)


def test_every_package_readme_has_an_install_command_naming_its_siblings():
    packages = discover()
    for package in packages.values():
        command = install_command(package)
        assert readme_install.CPU_TORCH in command
        for dep in package.deps:
            assert f"./packages/{dep}" in command, (package.name, dep)


def test_every_results_block_names_its_gpu_date_and_command():
    for name, table in readme_results.TABLES.items():
        text = readme_results.package_table(table, ROOT)
        first = text.splitlines()[0]
        assert "NVIDIA" in first and "made by `" in first and "2026-" in first, name


def test_flash_hopper_table_lists_the_sweeps_hopper_cases():
    from llmsys_dev.main_job import load_sweep

    sweep = load_sweep(ROOT / "packages" / "flash-attn2")
    labels = {case.label for case in sweep.hopper_cases()}
    assert set(readme_results.FLASH_HOPPER_CASES) == labels


def test_the_roofline_table_has_a_row_per_group_and_links_each_csv():
    text = readme_roofline.table(ROOT)
    assert all(f"| {group.label} |" in text for group in readme_roofline.GROUPS)
    links = re.findall(r"\]\(([^)]+\.csv)\)", text)
    readme = ROOT / readme_roofline.README
    assert {(readme.parent / link).resolve() for link in links} == {
        group.path(ROOT).resolve() for group in readme_roofline.GROUPS
    }


# A reader has no tracker to open: "issue 46" or "the assignment" means nothing without a link.
UNLINKED_REFERENCE = re.compile(r"\b[Ii]ssues? \d+|\bthe assignment\b|\bassignment's\b")


def unlinked_references(text: str) -> list[str]:
    """The lines of ``text`` that name an issue or the assignment with no link on the line."""
    return [
        line
        for line in text.splitlines()
        if UNLINKED_REFERENCE.search(line) and "](http" not in line
    ]


def test_no_readme_names_an_issue_or_the_assignment_without_a_link():
    readmes = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
    found = {
        str(path.relative_to(ROOT)): lines
        for path in readmes
        if (lines := unlinked_references(path.read_text()))
    }
    assert found == {}


def test_the_reference_check_sees_an_unlinked_issue():
    assert unlinked_references("as issue 46 asks\nthe CS336 assignment's reference") == [
        "as issue 46 asks",
        "the CS336 assignment's reference",
    ]
    assert unlinked_references("see [issue 46](https://example.org/46); issues of memory") == []
