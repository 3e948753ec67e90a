"""Compile the GEMM's candidate kernels ahead of time, in parallel worker processes.

The first call of a shape on a fresh machine compiles every candidate configuration the tuner
times (each a few seconds of ptxas on an H100). ``precompile`` runs those compilations in a pool
of spawned processes; Triton's on-disk cache then hands the binaries to the tuner in this
process. Optional: without it the first calls compile one kernel at a time. Used by sweep.py
(``harness.load_beside(__file__, "warmup")``).
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from llmsys.kernels_int8 import ops, tuning

Problem = tuple[int, int, int, torch.dtype]  # (M, N, K, output dtype)


def _compile(problem: Problem) -> list[str]:
    """Worker: run every candidate of one problem once; returns the failures."""
    m, n, k, out_dtype = problem
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t()  # (K, N)
    a_scale = torch.rand(m, device="cuda", dtype=out_dtype)
    b_scale = torch.rand(n, device="cuda", dtype=out_dtype)
    out = torch.empty(m, n, device="cuda", dtype=out_dtype)
    failures = []
    for config in tuning.matmul_candidates(m, n, k):
        if not ops.tma_applies(config, a, b, out):
            continue
        try:
            ops.launch_matmul(config, a, a_scale, b, b_scale, None, out)
        except Exception as error:  # e.g. OutOfResources: the tuner skips these too
            failures.append(f"{problem} {config}: {type(error).__name__}")
    torch.cuda.synchronize()
    return failures


def precompile(problems: Iterable[Problem], workers: int = 8) -> list[str]:
    """Compile every candidate kernel of ``problems`` in ``workers`` processes.

    Args:
        problems: (M, N, K, output dtype) tuples, e.g. a model's GEMMs at the batch sizes it
            serves. Problems whose candidates coincide compile once.
        workers: processes (each starts CUDA; 8 to 16 suit a 16-core host).

    Returns:
        One line per candidate that failed to compile (the tuner skips those), else [].
    """
    problems = list(dict.fromkeys(problems))
    if not problems or not torch.cuda.is_available():
        return []
    here = str(Path(__file__).parent)
    if here not in sys.path:  # the spawned workers import this module by its name to find _compile
        sys.path.append(here)
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(min(workers, len(problems)), mp_context=context) as pool:
        return [line for lines in pool.map(_compile, problems) for line in lines]
