"""Test configuration of kernels-moe: the poisoned-allocation fixture. (The root
conftest.py runs Triton under the interpreter on CPU-only machines, skips `gpu` tests there,
provides the `device` fixture and seeds every test.)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared helpers: moe_helpers.py

from moe_helpers import poisoned_allocations  # noqa: F401  (a fixture)
