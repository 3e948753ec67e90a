"""Compare a pytest-benchmark JSON run with a committed baseline: `python tools/bench_compare.py
NEW.json BASELINE.json` exits 1 when a median is more than 10% slower."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llmsys_bench.compare import main

if __name__ == "__main__":
    sys.exit(main())
