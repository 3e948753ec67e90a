"""The W8A8 GEMM at decode (M = 1 to 16) on Llama-3.1-8B's shapes against issue 26's targets.

The targets are on bandwidth: the int8 weight bytes over the GPU time, as a fraction of the
measured copy bandwidth.

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
import sys
from pathlib import Path

import torch

import llmsys.bench_harness as harness
from llmsys.bench_harness import results
from llmsys.kernels_int8 import ops, tuning
from llmsys.kernels_int8.tuning import MatmulConfig

gpu_time_ms = harness.load_beside(__file__, "sweep").gpu_time_ms  # L2 flushed before each call

RESULTS = Path(__file__).parent / "results"
SHAPES = [(m, 4096, n) for n in (14336, 4096) for m in (1, 8, 16)]  # (M, K, N): gate/up, o_proj
TARGETS = {14336: 0.70, 4096: 0.55}  # issue 26: fraction of the copy bandwidth, per N
GRID = [
    MatmulConfig(16, block_n, block_k, split_k, num_warps=warps, num_stages=stages)
    for block_n in (16, 32, 64)
    for block_k in (256, 512)
    for stages in (4, 6)
    for warps in (2, 4)
    for split_k in (1, 2, 4, 8)
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
    for config, tuned in configs(m, n, k):
        if not ops.tma_applies(config, a, b, out):
            continue
        p20, p50, p80 = gpu_time_ms(
            lambda c=config: ops.launch_matmul(c, a, a_scale, b, b_scale, None, out), "cuda"
        )
        rate = k * n / (p50 * 1e-3)  # int8 weight bytes per second
        rows.append(
            results.Row(
                "w8a8_gemm/decode", str(config), "gemm", f"M={m} K={k} N={n}", "int8",
                p20, p50, p80, throughput=rate / 1e9, throughput_unit="GB/s of int8 weights",
                roofline_fraction=rate / bandwidth,
                config=("the tuner's candidate" if tuned else "grid")
                + f"; copy bandwidth {bandwidth / 1e9:.0f} GB/s; target {TARGETS[n]:.0%}",
                **stamp,
            )
        )  # fmt: skip
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
            tuner = min((r for r in found if r.config.startswith("the tuner")), key=_time)
            best = min(found, key=_time)
            lines.append(
                f"M={m} K={k} N={n}: tuner's best {tuner.provider} {tuner.p50 * 1e3:.1f} us "
                f"({tuner.roofline_fraction:.0%}); overall best {best.provider} "
                f"{best.p50 * 1e3:.1f} us ({best.roofline_fraction:.0%}); target {TARGETS[n]:.0%}"
            )
            bar.update(1)
    print("\n".join(lines))
    path = results.write_csv(rows, args.out / f"decode_gemm_{results.device_slug('cuda')}.csv")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
