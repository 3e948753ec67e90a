"""The main job without nox: `python tools/bench.py --help` (a GPU host's own python works).

This file needs only the standard library: it checks the command line (so ``--help`` works
without torch), then runs the main job (``tools/llmsys_dev/main_job.py``) with every package's
source on PYTHONPATH, the route DESIGN.md gives for a GPU host without installs.

Everything runs under the ``__main__`` guard: sweeps start spawned worker processes (the int8
GEMM's parallel precompile), and a spawned worker re-runs this file as ``__mp_main__``; without
the guard every worker would run the whole main job again.
"""

import subprocess
import sys

from llmsys_dev.envs import source_env
from llmsys_dev.main_job import build_parser


def main() -> int:
    build_parser().parse_args()  # --help and argument errors, before anything heavy is imported
    command = [sys.executable, "-m", "llmsys_dev.main_job", *sys.argv[1:]]
    return subprocess.run(command, env=source_env()).returncode


if __name__ == "__main__":
    sys.exit(main())
