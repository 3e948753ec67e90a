"""The W8A8 GEMM at decode (M = 1 to 16) on Llama-3.1-8B's shapes against issue 26's targets.

The targets are on bandwidth: the int8 weight bytes over the GPU time, as a fraction of the
measured copy bandwidth. L2 is flushed before each call by reading 1 GiB, which leaves it
holding clean lines, as a layer of a model finds it after the layer before read its weights. A
flush by writing (do_bench's, and the int8 sweep's) leaves dirty lines whose write-back the GEMM
then pays as it reads: the tuner's pick is timed that way too, in a row of its own. So is a
plain read of the same bytes (``torch.sum``), the speed of streaming that many bytes once.

    python packages/kernels-int8/benchmarks/decode_gemm.py [--out DIR]

(with every package's src/ on PYTHONPATH). Needs a CUDA GPU. For each shape, every
configuration of the tuner's candidates (``tuning.matmul_candidates``) and of a grid around them
(BLOCK_N 16 to 64, BLOCK_K 256 and 512, 4 and 6 stages, 2 and 4 warps, split-K 1 to 8) is timed
with its epilogue, L2 flushed before each call (the sweep's ``gpu_time_ms``), on pre-quantized
rows. Writes one row per configuration to ``DIR/decode_gemm_<gpu>.csv`` (default: results/
beside this file) and prints, per shape, the best the tuner can pick and the best of all.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

import llmsys.bench_harness as harness
from llmsys.bench_harness import results
from llmsys.kernels_int8 import ops, tuning
from llmsys.kernels_int8.tuning import MatmulConfig

_sweep = harness.load_beside(__file__, "sweep")


def gpu_time_ms(fn, flush_by: str = "read") -> tuple[float, float, float]:
    """(p20, p50, p80) GPU milliseconds of one call, 1 GiB read (or written) before each."""
    return harness.time_ms(
        fn, device="cuda", rep_ms=_sweep.REP_MS, flush_bytes=_sweep.FLUSH_BYTES, flush_by=flush_by
    )


RESULTS = Path(__file__).parent / "results"
SHAPES = [(m, 4096, n) for n in (14336, 4096) for m in (1, 8, 16)]  # (M, K, N): gate/up, o_proj
TARGETS = {14336: 0.70, 4096: 0.55}  # issue 26: fraction of the copy bandwidth, per N
TUNED = "the tuner's candidate"
GRID = [
    MatmulConfig(16, block_n, block_k, split_k, num_warps=warps, num_stages=stages)
    for block_n in (16, 32, 64)
    for block_k in (256, 512)
    for stages in (4, 6)
    for warps in (2, 4)
    for split_k in (1, 2, 4, 8)
] + [
    MatmulConfig(16, block_n, 256, num_warps=4, num_stages=stages, tma=True, swap_ab=True)
    for block_n in (64, 128)
    for stages in (3, 4, 6)
]


def configs(m: int, n: int, k: int) -> list[tuple[MatmulConfig, bool]]:
    """(configuration, whether the tuner tries it), the tuner's first, without repeats."""
    tried = tuning.matmul_candidates(m, n, k)
    grid = [c for c in GRID if c not in tried and k >= 2 * c.split_k * c.block_k]
    return [(c, True) for c in tried] + [(c, False) for c in grid]


def measure(m: int, k: int, n: int, bandwidth: float, stamp: dict) -> list[results.Row]:
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t()  # (K, N), col-major
    a_scale = torch.rand(m, device="cuda", dtype=torch.float16)
    b_scale = torch.rand(n, device="cuda", dtype=torch.float16)
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)
    rows = []

    def add(provider: str, times: tuple, note: str) -> None:
        p20, p50, p80 = times
        rate = k * n / (p50 * 1e-3)  # int8 weight bytes per second
        rows.append(
            results.Row(
                "w8a8_gemm/decode", provider, "gemm", f"M={m} K={k} N={n}", "int8",
                p20, p50, p80, throughput=rate / 1e9, throughput_unit="GB/s of int8 weights",
                roofline_fraction=rate / bandwidth,
                config=f"{note}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
                f"target {TARGETS[n]:.0%}",
                **stamp,
            )
        )  # fmt: skip

    for config, tuned in configs(m, n, k):
        if not ops.tma_applies(config, a, b, out):
            continue
        call = functools.partial(ops.launch_matmul, config, a, a_scale, b, b_scale, None, out)
        add(str(config), gpu_time_ms(call), TUNED if tuned else "grid")
    picked = min((r for r in rows if r.config.startswith("the tuner")), key=_time)
    config = next(c for c, _ in configs(m, n, k) if str(c) == picked.provider)
    call = functools.partial(ops.launch_matmul, config, a, a_scale, b, b_scale, None, out)
    add(f"{config}, after a write flush", gpu_time_ms(call, "write"), "the tuner's best")
    weights = b.t().reshape(-1).view(torch.int32)  # the same bytes, read once
    total = torch.empty((), dtype=torch.int32, device="cuda")
    read = functools.partial(torch.sum, weights, dim=0, out=total)
    add("torch.sum over the weight bytes", gpu_time_ms(read), "a plain read of the same bytes")
    return rows


def _time(row: results.Row) -> float:
    return row.p50


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the CSV")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_gemm.py needs a CUDA GPU")
    bandwidth = harness.copy_bandwidth("cuda")
    stamp = {
        "gpu": results.device_name("cuda"),
        "version": f"torch {torch.__version__}",
        "timestamp": results.timestamp(),
    }
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)", flush=True)
    rows, lines = [], []
    with harness.progress_bar(desc="decode GEMM shapes", total=len(SHAPES)) as bar:
        for m, k, n in SHAPES:
            found = measure(m, k, n, bandwidth, stamp)
            rows += found
            gemms = [
                r for r in found if r.config.split(";")[0] in ("the tuner's candidate", "grid")
            ]
            tuner = min((r for r in gemms if r.config.startswith("the tuner")), key=_time)
            best = min(gemms, key=_time)
            read = next(r for r in found if r.provider.startswith("torch.sum"))
            lines.append(
                f"M={m} K={k} N={n}: tuner's best {tuner.provider} {tuner.p50 * 1e3:.1f} us "
                f"({tuner.roofline_fraction:.0%}); overall best {best.provider} "
                f"{best.p50 * 1e3:.1f} us ({best.roofline_fraction:.0%}); a plain read "
                f"{read.p50 * 1e3:.1f} us ({read.roofline_fraction:.0%}); target {TARGETS[n]:.0%}"
            )
            bar.update(1)
    print("\n".join(lines))
    path = results.write_csv(rows, args.out / f"decode_gemm_{results.device_slug('cuda')}.csv")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
