"""pytest configuration shared by every package's tests and benchmarks.

pytest imports this file before any test module, so on a machine without a GPU the Triton
kernels are switched to the interpreter (CPU tensors) before any package imports Triton.
"""

import os

import pytest
import torch

from llmsys_dev.ranks import run_ranks as _run_ranks

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


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, so a failure reproduces."""
    torch.manual_seed(0)


@pytest.fixture
def device() -> str:
    """Where the kernels run: the GPU if there is one, else the CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def run_ranks():
    """``run_ranks(fn, world_size=2, timeout=120, backend="gloo", **kwargs)``: distributed tests.

    Runs the module-level ``fn(rank, world_size, **kwargs)`` on that many torchrun-style processes
    and fails with every rank's output if one raises or the run passes the timeout
    (``tools/llmsys_dev/ranks.py``).
    """
    return _run_ranks


CALLS_PER_ROUND = 10  # GPU calls timed back to back between two synchronizations


@pytest.fixture
def timed(benchmark):
    """``timed(fn)``: time ``fn`` with pytest-benchmark and return its last result.

    ``fn`` is called once untimed first (compiling and tuning kernels). On a GPU each timed round
    runs ``fn`` CALLS_PER_ROUND times back to back and synchronizes once: a lone synchronize per
    call added 10-100 us of host jitter on our H100 host, enough to fail a 10% gate on a kernel
    of 50 us with nothing changed. Medians are per round (see ``extra_info``). Without a GPU,
    single calls (CI runs each body once with ``--benchmark-disable``).
    """

    def run(fn):
        result = fn()
        if not HAS_CUDA:
            return benchmark(fn)
        torch.cuda.synchronize()
        last = [result]

        def one_round():
            for _ in range(CALLS_PER_ROUND):
                last[0] = fn()
            torch.cuda.synchronize()

        benchmark.extra_info["calls_per_round"] = CALLS_PER_ROUND
        benchmark.pedantic(one_round, rounds=30, warmup_rounds=1)
        return last[0]

    return run
