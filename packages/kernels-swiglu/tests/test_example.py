"""examples/smallest.py says which path ran (``llmsys.triton_launch.kernel_path``)."""

import os
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smallest.py"


def test_the_example_names_the_path_that_ran():
    # One run (about 2 s); kernel_path's own test covers the interpreter's answer.
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run(
        [sys.executable, EXAMPLE], env=env, capture_output=True, text=True, check=True
    )
    path = "Triton kernel" if torch.cuda.is_available() else "eager fallback"
    assert f"| ran: {path} |" in done.stdout
