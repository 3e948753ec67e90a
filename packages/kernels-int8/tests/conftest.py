"""Test configuration of kernels-int8: the autotuner off by default, and outputs poisoned before
the kernels write them. (The root conftest.py runs Triton under the interpreter on CPU-only
machines, skips `gpu` tests there, provides the `device` fixture and seeds every test.)

pytest imports this file before any test module, so the environment variable is set before the
package is imported.
"""

import os

import pytest
import torch

# Take each shape's first (best-measured) GEMM configuration instead of timing them all; the
# tests that need the tuner turn it back on.
os.environ.setdefault("LLMSYS_INT8_AUTOTUNE", "0")

# What the poisoned allocator fills new tensors with: NaN for floats, and for integers a value
# no kernel output may hold (the quantizer never writes -128; partial sums are never this odd).
POISON = {torch.int8: -128, torch.int32: 1_234_567_891}


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fill every tensor the launchers allocate (``torch.empty``) with POISON or NaN, so an
    element that no kernel writes fails the test."""
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            return t.fill_(float("nan"))
        return t.fill_(POISON[t.dtype]) if t.dtype in POISON else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
