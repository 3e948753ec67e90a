"""Test helpers of the profiling package (the root conftest.py seeds every test and runs Triton
under the interpreter on CPU-only machines)."""

import pytest
import torch

from llmsys.profiling import e2e

OOM_CONTEXT = 16  # the context length at which `oom_at_context_16` runs out of memory


@pytest.fixture
def oom_at_context_16(monkeypatch):
    """Every model step at context 16 raises CUDA's out-of-memory error; others run."""
    real_step = e2e.Runner.step

    def step(self):
        if self.config.context_length == OOM_CONTEXT:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(self)

    monkeypatch.setattr(e2e.Runner, "step", step)
