"""Test configuration: Triton's interpreter on CPU-only machines, a `device` fixture, `gpu` skips.

pytest imports this file before any test module, so the environment variable is set before Triton
or the package is imported.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # run the Triton kernels on CPU tensors


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
