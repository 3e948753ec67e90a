"""Test configuration of flash-attn2: the NaN-poisoned outputs fixture. (The root
conftest.py runs Triton under the interpreter on CPU-only machines, skips `gpu` tests there,
provides the `device` fixture and seeds every test.)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared helpers: attn_helpers.py

from attn_helpers import nan_outputs  # noqa: F401  (a fixture)
