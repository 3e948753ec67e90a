"""pytest configuration shared by every package's tests and benchmarks.

pytest imports this file before any test module, so on a machine without a GPU the Triton
kernels are switched to the interpreter (CPU tensors) before any package imports Triton.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped, with that reason, where there is no CUDA GPU."""
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    """Where the kernels run: the GPU if there is one, else the CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
