"""Write the generated parts of every README from the checkout: `python tools/readme_tables.py`.

- Each package README's Install section (between ``<!-- install -->`` markers), from the
  package's sibling dependencies and extras in its ``pyproject.toml``. The isolation check
  (``nox -s isolation``) runs the install command in it as written.
- The results tables (between ``<!-- results:NAME -->`` markers), from the committed CSVs under
  ``packages/*/benchmarks/results/``; what each table shows is declared in
  ``llmsys_dev/readme_results.py``.
- The profiling README's table of measured against predicted time (the block
  ``results:profiling-roofline-check``), from the same CSVs by ``llmsys-roofline check``'s
  model; its groups of rows are declared in ``llmsys_dev/readme_roofline.py``.

``--check`` writes nothing and fails if a README differs from what this would write (CI runs it
as ``tools/tests/test_readmes.py``). After a new GPU run commits its CSV, run this script and
commit the READMEs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmsys_dev import readme_install, readme_results, readme_roofline
from llmsys_dev.workspace import ROOT


def generate(root: Path = ROOT) -> dict[Path, str]:
    """Every README's text as it should be, by path (only those with generated parts)."""
    texts: dict[Path, str] = {}
    for path, text in readme_install.generate(root).items():
        texts[path] = text
    for path, text in readme_results.generate(root, texts).items():
        texts[path] = text
    for path, text in readme_roofline.generate(root, texts).items():
        texts[path] = text
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; fail if a README is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for path, text in generate().items():
        if path.read_text() != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print("out of date (run `python tools/readme_tables.py`):", *stale, sep="\n  ")
        return 1
    print(("up to date" if not stale else "wrote") + f": {len(stale)} README(s) changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
