"""Test configuration of kernels-int8: the autotuner off by default. (The root conftest.py runs
Triton under the interpreter on CPU-only machines, skips `gpu` tests there, and provides the
`device`, seed and `poisoned_allocations` fixtures.)

pytest imports this file before any test module, so the environment variable is set before the
package is imported.
"""

import os

import pytest

# Take each shape's first (best-measured) GEMM configuration instead of timing them all; the
# tests that need the tuner turn it back on.
os.environ.setdefault("LLMSYS_INT8_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test starts without plans: a plan keeps the configuration it was built with, so a
    test that forces one (a patched ``tuning.matmul_candidates``, ``ops.MAX_K_PER_SPLIT``)
    must not meet a plan from an earlier test. Tests that force several in a row clear
    ``tuning.plans`` after each."""
    from llmsys.kernels_int8 import tuning

    tuning.plans.clear()
    yield
    tuning.plans.clear()
