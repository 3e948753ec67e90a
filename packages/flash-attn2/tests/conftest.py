"""The tests' shared helpers (attn_helpers.py) on the path. (The root conftest.py runs Triton under
the interpreter on CPU-only machines, skips `gpu` tests there, and provides the `device`, seed and
`poisoned_allocations` fixtures.)"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Every test starts without forward or backward plans: a plan keeps the tiles and
    constants it was built with, so a test that patches them (``ops.tile_configs``,
    ``ops.DOT_PRECISION``) must not meet a plan from an earlier test."""
    from llmsys.flash_attn2 import ops

    ops._forward_plans.clear()
    ops._backward_plans.clear()
    yield
    ops._forward_plans.clear()
    ops._backward_plans.clear()
