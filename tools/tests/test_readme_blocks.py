"""Every ```python block of every README runs as pasted, on CPU, in a fresh interpreter.

A README block is the first code a user runs; one that needs names it does not define, or a GPU,
fails them before they read any further. Each block runs in its own subprocess with the sources of
every package on ``PYTHONPATH`` (no install) and Triton's interpreter on, so the kernels run on CPU
tensors; it runs in a temporary directory, so whatever it saves stays out of the checkout.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
TIMEOUT_S = 300


def _blocks() -> list:
    params = []
    for readme in READMES:
        text = readme.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            name = f"{readme.relative_to(ROOT).as_posix()}:{line}"
            params.append(pytest.param(match.group(1), id=name))
    return params


BLOCKS = _blocks()


def test_the_readmes_have_python_blocks():
    assert len(BLOCKS) >= 10, "the block pattern no longer finds the READMEs' ```python blocks"


@pytest.mark.parametrize("code", BLOCKS)
def test_readme_block_runs_as_pasted_on_cpu(code, tmp_path):
    src = [str(path) for path in sorted(ROOT.glob("packages/*/src"))]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "",  # the interpreter runs kernels on CPU tensors: a CPU host
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a plain `python` run, as the READMEs describe it
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"the block ran past {TIMEOUT_S} s:\n{timeout.stderr or ''}")
    assert done.returncode == 0, f"the block failed (rc {done.returncode}):\n{done.stderr}"
