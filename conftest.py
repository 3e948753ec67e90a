"""pytest configuration shared by every package's tests and benchmarks.

pytest imports this file before any test module, so on a machine without a GPU the Triton
kernels are switched to the interpreter (CPU tensors) before any package imports Triton
(``tools/llmsys_dev/device.py``, importable through pytest's ``pythonpath`` setting in the
root pyproject.toml; tests and benchmarks that size their cases at import read
``ON_GPU`` and ``DEVICE`` from there too).
"""

import sys
from collections.abc import Iterator

import pytest
import torch

from llmsys_dev.device import DEVICE, ON_GPU
from llmsys_dev.ranks import run_ranks as _run_ranks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped, with that reason, where there is no CUDA GPU."""
    if ON_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state, so a failure reproduces."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_plans_from_earlier_tests() -> None:
    """Every test starts without recorded plans (``llmsys.triton_launch.forget``): a test that
    patches what an impl reads (a launch configuration, a kernel helper) must meet the impl,
    not a plan another test recorded."""
    library = sys.modules.get("llmsys.triton_launch.library")
    if library is not None:
        library.forget()


@pytest.fixture
def device() -> str:
    """Where the kernels run: the GPU if there is one, else the CPU under the interpreter."""
    return DEVICE


# What a poisoned allocation holds: NaN for floats; for integers a value no kernel output holds
# (the int8 quantizer never writes -128; no partial sum, index or count is this odd).
POISON = {
    torch.int8: -128,
    torch.uint8: 77,
    torch.int16: -7_777,
    torch.int32: 1_234_567_891,
    torch.int64: 1_234_567_891,
}


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a fresh tensor with its poison value (booleans are left as they are)."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    return t.fill_(POISON[t.dtype]) if t.dtype in POISON else t


@pytest.fixture
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` returns poison, so an
    output element that no kernel writes fails the test. Recorded plans are off meanwhile: a
    replay allocates in C++, past these functions (it launches the same kernels)."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison_(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison_(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **k: poison_(new_empty(*a, **k)))
    library = sys.modules.get("llmsys.triton_launch.library")
    if library is None:  # no op has been defined yet, so none has a plan
        yield
        return
    with library.disabled():
        yield


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
        if not ON_GPU:
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
