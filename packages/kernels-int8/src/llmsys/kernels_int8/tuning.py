"""Launch configurations: the quantizer's heuristic, and the GEMM's candidates and autotuner.

The GEMM's candidates depend on M's bucket (decode, mid, prefill). On a GPU the first call for a
(bucket, N, K, layout, dtype) key times every candidate, split-K included, and caches the
fastest for the life of the process; under the interpreter, during CUDA-graph capture or with
``LLMSYS_INT8_AUTOTUNE=0`` the first candidate (the best one measured on an H100, see
DECISIONS.md) is used without timing.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable

import torch
import triton

from llmsys.triton_launch import cdiv, forget, next_power_of_2

AUTOTUNE = os.environ.get("LLMSYS_INT8_AUTOTUNE", "1") != "0"
TUNE_LOG = os.environ.get("LLMSYS_INT8_TUNE_LOG", "0") == "1"  # print every candidate's time


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """One launch of the GEMM: tile shape, split-K, launch order, pipelining, and kernel.

    ``tma`` picks ``perrow_w8a8_matmul_tma_kernel`` (persistent, TMA loads; no split-K), with
    ``tma_store`` its TMA-store epilogue and ``swap_ab`` its decode form (the weight tile on the
    MMA's wide side); otherwise ``perrow_w8a8_matmul_kernel``.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    tma_store: bool = False
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.swap_ab and (not self.tma or self.tma_store):
            raise ValueError("swap_ab needs tma=True and tma_store=False")

    def __str__(self) -> str:
        kernel = ("tma-store " if self.tma_store else "tma ") if self.tma else ""
        kernel += "swap " if self.swap_ab else ""
        return (
            f"{kernel}{self.block_m}x{self.block_n}x{self.block_k} split{self.split_k} "
            f"g{self.group_m} w{self.num_warps} s{self.num_stages}"
        )


def m_bucket(m: int) -> int:
    """The power of two at or above ``m`` (at least 16, at most 16384): the tuner's key for M."""
    return min(max(16, next_power_of_2(m)), 16384)


def matmul_candidates(m: int, n: int, k: int) -> list[MatmulConfig]:
    """The configurations tried for an (m, k) x (k, n) product, best-known first.

    Measured on an H100 (DECISIONS.md): prefill tiles of 128 x 256 x 128 with 8 warps and
    3 stages through the persistent TMA kernel keep the int8 tensor cores busiest (the launcher
    drops TMA candidates whose operands the copy engine cannot address); decode is memory-bound
    on B, so it wants small BLOCK_M, narrow BLOCK_N, long BLOCK_K and deep pipelines, and split-K
    where N alone gives too few programs for the 132 SMs.
    """
    bucket = m_bucket(m)
    if bucket >= 256:
        return [
            MatmulConfig(128, 256, 128, num_warps=8, num_stages=3, tma=True),
            MatmulConfig(128, 256, 128, num_warps=8, num_stages=4, tma=True, tma_store=True),
            MatmulConfig(128, 256, 128, num_warps=8, num_stages=3, tma=True, tma_store=True),
            MatmulConfig(256, 128, 128, num_warps=8, num_stages=3, tma=True),
            MatmulConfig(128, 256, 128, group_m=16, num_warps=8, num_stages=3, tma=True),
            MatmulConfig(128, 256, 128, num_warps=8, num_stages=3),
            # Added after the committed H100 sweep, unmeasured there: at M = 256 to 1024 with
            # N = 2048 the 128 x 256 tiles leave SMs idle (0.58x to 0.92x of cuBLAS in
            # results/h100.csv); these smaller tiles, each verified in the smaller buckets,
            # give the tuner more programs to choose from.
            MatmulConfig(128, 128, 128, num_warps=8, num_stages=4, tma=True),
            MatmulConfig(64, 128, 128, num_warps=4, num_stages=4),
            MatmulConfig(64, 64, 256, num_warps=4, num_stages=4),
        ]
    if bucket >= 64:
        return [
            MatmulConfig(64, 128, 128, num_warps=4, num_stages=4),
            MatmulConfig(128, 128, 128, num_warps=8, num_stages=4, tma=True),
            MatmulConfig(64, 64, 256, num_warps=4, num_stages=4),
            MatmulConfig(128, 256, 128, num_warps=8, num_stages=3),
        ]
    block_m = bucket
    configs = []
    # The pointer kernel only: the TMA kernel with the product swapped (swap_ab) streams the
    # weights faster on the GPU, but each launch costs the host 30.5 us against 11.8 on an
    # H100 host, which made the 8B model's eager decode step 27% slower and its CUDA-graph step
    # no faster (DECISIONS.md).
    pointer_tiles = [(32, 256, 5), (64, 256, 4), (64, 128, 5), (64, 512, 6)]
    if n < 8192:  # the best of the grid at N 4096, M 8 and 16 (results/decode_gemm_h100.csv)
        pointer_tiles.append((32, 512, 4))
    for block_n, block_k, stages in pointer_tiles:
        tiles = cdiv(m, block_m) * cdiv(n, block_n)
        for split_k in dict.fromkeys((1, _split_to_fill(tiles, k, block_k))):
            configs.append(
                MatmulConfig(block_m, block_n, block_k, split_k, num_warps=4, num_stages=stages)
            )
    return configs


def _split_to_fill(tiles: int, k: int, block_k: int, programs: int = 264) -> int:
    """The split-K factor (a power of two, at most 8) that brings ``tiles`` near ``programs``,
    keeping at least two K blocks per split."""
    split = 1
    while split < 8 and tiles * split < programs and k >= 4 * split * block_k:
        split *= 2
    return split


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """One launch of the quantizer: ``block_m`` rows of ``block_k`` columns per program and
    step, in one pass over x or two."""

    block_m: int
    block_k: int
    one_pass: bool
    num_warps: int


ONE_PASS_MAX_K = 4096  # longer rows take two passes: one program per long row holds too few
# loads in flight (16384 x 5120 ran at 44% of the copy bandwidth in one pass, 72% in two)


def quantize_config(m: int, k: int) -> QuantizeConfig:
    """Rows per block, block width, passes, warps and grid for quantizing an (m, k) tensor.

    Measured on an H100 (DECISIONS.md): rows of up to 4096 elements in one pass, about
    4096 elements per program (2 rows of 2048 with 4 warps; 1 row of 4096 with 8); longer rows
    in two passes over blocks of 2048 or 4096 columns, whichever pads the row less.
    """
    block_k = next_power_of_2(max(k, 1))
    if block_k <= ONE_PASS_MAX_K:
        block_m = max(1, min(4096 // block_k, next_power_of_2(max(m, 1))))
        return QuantizeConfig(block_m, block_k, True, 4 if block_k <= 2048 else 8)
    block_k = min((4096, 2048), key=lambda b: (cdiv(k, b) * b, -b))
    return QuantizeConfig(1, block_k, False, 4)


# --- the autotuner -------------------------------------------------------------------------------

_best: dict[tuple, MatmulConfig] = {}


def tuned(
    key: tuple,
    candidates: Callable[[], list[MatmulConfig]],
    launch: Callable[[MatmulConfig], None],
    device: torch.device,
) -> MatmulConfig:
    """The fastest of ``candidates()`` for ``key``, timed once per process; else the first.

    A cached key returns at once (the candidates are not even listed: this is every call's
    path after the first). ``launch(config)`` must run the whole product with that
    configuration; it is timed with CUDA events (triton.testing.do_bench), so the candidates'
    results are overwritten by the caller's own launch afterwards. Nothing is cached while not
    tuning (``device`` not CUDA, ``LLMSYS_INT8_AUTOTUNE=0``, CUDA-graph capture), so the first
    candidate is asked for on every call.
    """
    best = _best.get(key)
    if best is not None:
        return best
    configs = candidates()
    if not configs:
        raise ValueError(f"no GEMM configuration applies to {key}")
    if device.type != "cuda" or not AUTOTUNE or torch.cuda.is_current_stream_capturing():
        return configs[0]
    from triton.testing import do_bench

    timings: dict[MatmulConfig, float] = {}
    with torch.cuda.device(device):  # do_bench's events time the current device
        for config in configs:
            try:
                timings[config] = do_bench(lambda config=config: launch(config), warmup=5, rep=20)
            except triton.runtime.errors.OutOfResources:
                continue  # too much shared memory for this GPU: not a candidate here
            except Exception as error:  # a compiler failure must not take the call down with it
                warnings.warn(f"llmsys int8 GEMM: skipping {config}: {error!r}", stacklevel=3)
    best = min(timings, key=timings.__getitem__) if timings else configs[0]
    _best[key] = best
    if TUNE_LOG:
        listed = ", ".join(
            f"{c}: {ms * 1e3:.1f} us" for c, ms in sorted(timings.items(), key=lambda kv: kv[1])
        )
        print(f"[llmsys int8 tune] M<={key[0]} N={key[1]} K={key[2]}: {listed}", flush=True)
    return best


def clear_cache() -> None:
    """Forget every tuned configuration (the next call of each shape tunes again), and the
    recorded replays of every op, which would go on launching the configurations they were
    recorded with."""
    _best.clear()
    forget()
