"""Test configuration of flash-attn2: a fixed seed and the NaN-poisoned outputs fixture. (The root
conftest.py runs Triton under the interpreter on CPU-only machines, skips `gpu` tests there and
provides the `device` fixture.)"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the tests' shared helpers: attn_helpers.py

from attn_helpers import nan_outputs  # noqa: F401  (a fixture)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
