"""The main job without nox: `python tools/bench.py --help` (a GPU host's own python works)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llmsys_dev.workspace import source_paths

sys.path[:0] = source_paths()
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton

from llmsys_bench.report import main  # noqa: E402

sys.exit(main())
