"""The README's torchrun example, as a user runs it: 2 CPU ranks, then one plain process."""

import os
import re
import subprocess
import sys
from pathlib import Path

from llmsys_dev.ranks import free_port

EXAMPLE = Path(__file__).parents[1] / "examples" / "smallest.py"


def run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=os.environ)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_torchrun_two_cpu_ranks_train_and_stay_identical():
    out = run(
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), str(EXAMPLE),
    )  # fmt: skip
    losses = {
        int(step): float(loss) for step, loss in re.findall(r"step +(\d+) loss ([\d.]+)", out)
    }
    assert losses[59] < losses[0] / 10, out
    assert "rank 1: done" in out and "rank 0: done" in out


def test_plain_python_is_one_rank():
    out = run(sys.executable, str(EXAMPLE))
    assert "rank 0/1 step 59" in out and "rank 0: done" in out
