"""The main job without nox: `python tools/bench.py --help` (a GPU host's own python works).

Everything runs under the ``__main__`` guard: sweeps start spawned worker processes (the int8
GEMM's parallel precompile), and a spawned worker re-runs this file as ``__mp_main__``; without
the guard every worker would run the whole main job again.
"""

import sys
from pathlib import Path


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llmsys_dev.device  # noqa: F401  (the interpreter without a GPU, before Triton loads)
    from llmsys_dev.workspace import source_paths

    sys.path[:0] = source_paths()
    from llmsys_bench.report import main as run_main_job

    return run_main_job()


if __name__ == "__main__":
    sys.exit(main())
