"""One-off GPU exploration behind the design choices (benchmarks/NOTES.md records the outcome).

1. Prefill (M = 16384, the four Qwen2.5-3B GEMMs): cuBLAS fp16/bf16, torch._int_mm (+ rescale),
   and our GEMM with every candidate tile config, plus two variants kept here only: a persistent
   grid with a flattened tile loop, and TMA (tensor-descriptor) loads, persistent or not.
2. Decode (M = 1, 16, 32 on the same weights): cuBLAS fp16 and every small-M config, split-K too.
3. Quantization: launch configurations against the copy bandwidth and eager.

Every kernel is compiled first by a pool of worker processes (compilation is most of a cold
run); each job is checked against the eager spec before it is timed.
    python benchmarks/explore.py [--part prefill,decode,quant] [--budget-s 200]
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

from llmsys.kernels_int8 import kernels, ops, reference, tuning
from llmsys.kernels_int8.tuning import MatmulConfig
from llmsys_bench import harness

QWEN = [(2048, 6144), (2048, 2048), (2048, 22016), (11008, 2048)]  # (K, N)
PREFILL_M = 16384
DECODE_M = [1, 16, 32]

PREFILL_CONFIGS = {
    "plain": [
        MatmulConfig(128, 256, 128, num_warps=8, num_stages=3),
        MatmulConfig(128, 256, 128, num_warps=8, num_stages=4),
        MatmulConfig(256, 128, 128, num_warps=8, num_stages=3),
        MatmulConfig(128, 128, 128, num_warps=8, num_stages=4),
        MatmulConfig(128, 128, 128, num_warps=4, num_stages=4),
        MatmulConfig(128, 256, 64, num_warps=8, num_stages=4),
        MatmulConfig(128, 128, 256, num_warps=8, num_stages=3),
    ],
    "persistent": [
        MatmulConfig(128, 256, 128, num_warps=8, num_stages=3),
        MatmulConfig(128, 128, 128, num_warps=8, num_stages=4),
    ],
    "tma": [
        MatmulConfig(128, 256, 128, num_warps=8, num_stages=3),
        MatmulConfig(128, 256, 128, num_warps=8, num_stages=4),
        MatmulConfig(128, 128, 128, num_warps=8, num_stages=4),
    ],
    "tma_persistent": [
        MatmulConfig(128, 256, 128, num_warps=8, num_stages=3),
        MatmulConfig(128, 128, 128, num_warps=8, num_stages=4),
    ],
}


def decode_configs(m: int) -> list[MatmulConfig]:
    bm = 16 if m <= 16 else 32
    out = []
    for bn, bk, stages in ((64, 128, 5), (128, 128, 4), (64, 256, 4), (32, 256, 5), (128, 256, 3)):
        for split in (1, 2, 4, 8):
            out.append(MatmulConfig(bm, bn, bk, split, num_warps=4, num_stages=stages))
    return out


# --- variants kept only for this exploration -----------------------------------------------------


@triton.jit
def _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def persistent_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Assumes K % BLOCK_K == 0, a row-major, b column-major, c row-major.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_ptrs = a_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + offs_k[:, None] + (offs_n % N).to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        out = kernels._scale_epilogue(
            acc, a_scale_ptr, b_scale_ptr, b_scale_ptr, offs_m, offs_n, M, N, False
        )
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def tma_kernel(
    a_desc,
    b_desc,
    c_desc,
    a_scale_ptr,
    b_scale_ptr,
    M,
    N,
    K,
    NUM_PROGRAMS: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    if PERSISTENT:
        start, step = tl.program_id(0), NUM_PROGRAMS
    else:
        start, step = tl.program_id(0), num_tiles
    for tile_id in tl.range(start, num_tiles, step, flatten=True):
        pid_m, pid_n = _tile_ids(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([pid_m * BLOCK_M, k])  # (BLOCK_M, BLOCK_K)
            b = b_desc.load([pid_n * BLOCK_N, k])  # (BLOCK_N, BLOCK_K): b column-major
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = kernels._scale_epilogue(
            acc, a_scale_ptr, b_scale_ptr, b_scale_ptr, offs_m, offs_n, M, N, False
        )
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out.to(c_desc.dtype))


NUM_SMS = (
    torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4
)


def launch_variant(variant: str, config: MatmulConfig, a, a_scale, b, b_scale, out) -> None:
    (m, k), n = a.shape, b.shape[1]
    if variant == "plain":
        ops.launch_matmul(config, a, a_scale, b, b_scale, None, out)
        return
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    meta = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "GROUP_M": config.group_m,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    if variant == "persistent":
        grid = min(NUM_SMS, tiles)
        persistent_kernel[(grid,)](
            a, b, out, a_scale, b_scale, m, n, k, a.stride(0), b.stride(1), out.stride(0),
            NUM_PROGRAMS=grid, **meta,
        )  # fmt: skip
        return
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
    b_desc = TensorDescriptor.from_tensor(b.t(), [config.block_n, config.block_k])
    c_desc = TensorDescriptor.from_tensor(out, [config.block_m, config.block_n])
    persistent = variant == "tma_persistent"
    grid = min(NUM_SMS, tiles) if persistent else tiles
    tma_kernel[(grid,)](
        a_desc, b_desc, c_desc, a_scale, b_scale, m, n, k,
        NUM_PROGRAMS=grid, PERSISTENT=persistent, **meta,
    )  # fmt: skip


# --- jobs: compile in a pool, then check and time one at a time ----------------------------------


def gemm_operands(m, n, k, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=device, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g).t()
    a_scale = (torch.rand(m, device=device, generator=g) * 0.01 + 1e-3).half()
    b_scale = (torch.rand(n, device=device, generator=g) * 0.001 + 1e-4).half()
    return a, a_scale, b, b_scale


def compile_job(job) -> str:
    """Worker: run one (variant, config, shape) once so the Triton cache holds its binary."""
    variant, config, (m, n, k) = job
    try:
        a, a_scale, b, b_scale = gemm_operands(m, n, k, "cuda")
        out = torch.empty(m, n, dtype=torch.float16, device="cuda")
        launch_variant(variant, config, a, a_scale, b, b_scale, out)
        torch.cuda.synchronize()
        return "ok"
    except Exception as error:  # reported, not fatal: one failing variant must not stop the run
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def precompile(jobs, workers: int = 12) -> dict:
    started = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        results = dict(zip(jobs, pool.map(compile_job, jobs), strict=True))
    failed = {job: r for job, r in results.items() if r != "ok"}
    print(f"precompiled {len(jobs)} jobs in {time.perf_counter() - started:.1f} s; "
          f"{len(failed)} failed", flush=True)  # fmt: skip
    for (variant, config, shape), why in failed.items():
        print(f"  FAILED {variant} {config} {shape}: {why}")
    return results


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def time_gemm(variant, config, m, n, k) -> tuple[float, bool]:
    a, a_scale, b, b_scale = gemm_operands(m, n, k, "cuda", seed=1)
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    launch_variant(variant, config, a, a_scale, b, b_scale, out)
    rows = slice(0, min(m, 64))
    expected = reference.matmul_int8_reference(a[rows], a_scale[rows], b, b_scale)
    exact = torch.equal(out[rows], expected) and not torch.isnan(out).any()
    return median_ms(lambda: launch_variant(variant, config, a, a_scale, b, b_scale, out)), exact


def baselines(m, n, k) -> dict[str, float]:
    x16 = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
    xbf, wbf = x16.bfloat16(), w16.bfloat16()
    times = {
        "cublas_fp16": median_ms(lambda: torch.matmul(x16, w16.t())),
        "cublas_bf16": median_ms(lambda: torch.matmul(xbf, wbf.t())),
    }
    if m > 16:
        a, a_scale, b, b_scale = gemm_operands(m, n, k, "cuda")
        times["int_mm"] = median_ms(lambda: torch._int_mm(a, b))

        def int_mm_rescaled():
            acc = torch._int_mm(a, b)
            return (acc.float() * a_scale.float()[:, None] * b_scale.float()[None, :]).half()

        times["int_mm_rescale"] = median_ms(int_mm_rescaled)
    return times


def prefill(deadline: float) -> None:
    print("\n## prefill M = 16384 (ms; TOP/s)")
    totals: dict[str, float] = {}
    for k, n in QWEN:
        if time.perf_counter() > deadline:
            print("budget spent: stopping prefill")
            return
        ops_count = 2 * PREFILL_M * n * k
        for name, ms in baselines(PREFILL_M, n, k).items():
            totals[name] = totals.get(name, 0) + ms
            print(f"K={k:5} N={n:5} {name:28} {ms:8.4f} ms {ops_count / ms / 1e9:7.1f}", flush=True)
        for variant, configs in PREFILL_CONFIGS.items():
            for config in configs:
                try:
                    ms, exact = time_gemm(variant, config, PREFILL_M, n, k)
                except Exception as error:
                    print(f"K={k:5} N={n:5} {variant} {config}: {type(error).__name__}")
                    continue
                name = f"{variant} {config}"
                totals[name] = totals.get(name, 0) + ms
                print(f"K={k:5} N={n:5} {name:28} {ms:8.4f} ms {ops_count / ms / 1e9:7.1f} "
                      f"exact={exact}", flush=True)  # fmt: skip
    fp16 = totals.get("cublas_fp16")
    print("\n## prefill totals over the four shapes")
    for name, ms in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"{name:40} {ms:8.4f} ms  x_fp16={fp16 / ms if fp16 else 0:5.2f}")


def decode(deadline: float) -> None:
    print("\n## decode (ms; fraction of the int8 bandwidth floor)")
    bandwidth = harness.copy_bandwidth("cuda")
    for m in DECODE_M:
        totals: dict[str, float] = {}
        for k, n in QWEN:
            if time.perf_counter() > deadline:
                print("budget spent: stopping decode")
                return
            floor_ms = (k * n + m * k + 2 * m * n) / bandwidth * 1e3
            base = baselines(m, n, k)
            totals["cublas_fp16"] = totals.get("cublas_fp16", 0) + base["cublas_fp16"]
            results = []
            for config in decode_configs(m):
                try:
                    ms, exact = time_gemm("plain", config, m, n, k)
                except Exception as error:
                    print(f"M={m} K={k} N={n} {config}: {type(error).__name__}")
                    continue
                results.append((ms, str(config), exact))
                totals[str(config)] = totals.get(str(config), 0) + ms
            results.sort()
            best = ", ".join(
                f"{c} {ms * 1e3:.1f}us{'' if e else ' INEXACT'}" for ms, c, e in results[:4]
            )
            print(f"M={m:2} K={k:5} N={n:5} fp16 {base['cublas_fp16'] * 1e3:6.1f}us "
                  f"floor {floor_ms * 1e3:5.1f}us | {best}", flush=True)  # fmt: skip
            tuned = tuning.matmul_candidates(m, n, k)
            print(f"    current candidates: {[str(c) for c in tuned]}")
        fp16 = totals.pop("cublas_fp16")
        best = sorted(totals.items(), key=lambda kv: kv[1])[:3]
        listed = "; ".join(f"{c} {ms * 1e3:.1f}us ({fp16 / ms:.2f}x)" for c, ms in best)
        print(f"M={m}: fp16 total {fp16 * 1e3:.1f}us; best single configs {listed}")


def quant_configs(k: int) -> list[tuning.QuantizeConfig]:
    """Launch configurations to compare for rows of k elements."""
    q = tuning.QuantizeConfig
    block_k = triton.next_power_of_2(k)
    if block_k <= 4096:
        found = [q(1, block_k, True, w) for w in (2, 4, 8)]
        found += [q(2, block_k, True, w) for w in (4, 8)] + [q(4, block_k, True, 8)]
    else:
        found = [q(bm, bk, False, w) for bk in (2048, 4096) for bm, w in ((1, 4), (2, 8))]
        found += [q(1, 16384, True, 16)]
    return [*found, tuning.quantize_config(16384, k)]


def quant(deadline: float) -> None:
    print("\n## quantization (us; fraction of copy bandwidth; speed-up over the faster eager)")
    bandwidth = harness.copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    shapes = [
        (16384, 2048),
        (8192, 2048),
        (1024, 2048),
        (4096, 4096),
        (16384, 11008),
        (16384, 5120),
    ]
    for m, k in shapes:
        if time.perf_counter() > deadline:
            print("budget spent: stopping quant")
            return
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        moved = m * k * 3 + m * 2

        def eager_native(x=x):
            scale = x.abs().amax(dim=1, keepdim=True) / 127
            return (x / scale).round().clamp(-127, 127).to(torch.int8), scale

        eager = {
            "eager spec (fp32)": median_ms(lambda x=x: reference.quantize_int8_perrow_reference(x)),
            "eager native fp16": median_ms(eager_native),
        }
        fastest_eager = min(eager.values())
        line = ", ".join(f"{n} {ms * 1e3:.1f}us" for n, ms in eager.items())
        print(f"{m}x{k}: {line}; copy floor {moved / bandwidth * 1e6:.1f}us")
        q_ref, s_ref = reference.quantize_int8_perrow_reference(x)
        original = tuning.quantize_config
        for config in dict.fromkeys(quant_configs(k)):
            try:
                tuning.quantize_config = lambda m, k, c=config: c
                q, s = torch.ops.llmsys.int8_quantize_perrow(x)
                exact = torch.equal(q, q_ref) and torch.equal(s, s_ref)
                ms = median_ms(lambda x=x: torch.ops.llmsys.int8_quantize_perrow(x))
            except Exception as error:
                print(f"  {config}: {type(error).__name__}: {str(error)[:100]}")
                continue
            finally:
                tuning.quantize_config = original
            print(f"  {config}: {ms * 1e3:7.1f}us {moved / ms / 1e9 / bandwidth * 1e12:5.1%} "
                  f"x_eager={fastest_eager / ms:4.2f} exact={exact}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="quant,prefill,decode")
    parser.add_argument("--budget-s", type=float, default=200)
    parser.add_argument("--workers", type=int, default=12)
    args = parser.parse_args()
    started = time.perf_counter()
    deadline = started + args.budget_s
    parts = args.part.split(",")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), NUM_SMS, "SMs")
    prefill_candidates = tuning.matmul_candidates(16384, 2048, 2048)
    print(f"prefill candidates: {[str(c) for c in prefill_candidates]}")
    jobs = []
    if "prefill" in parts:
        jobs += [
            (variant, config, (PREFILL_M, n, k))
            for k, n in QWEN
            for variant, configs in PREFILL_CONFIGS.items()
            for config in configs
        ]
    if "decode" in parts:
        jobs += [
            ("plain", config, (m, n, k))
            for m in DECODE_M
            for k, n in QWEN
            for config in decode_configs(m)
        ]
    if jobs:
        precompile(list(dict.fromkeys(jobs)), args.workers)
    for part in parts:
        try:
            {"prefill": prefill, "decode": decode, "quant": quant}[part](deadline)
        except Exception:
            traceback.print_exc()
        print(f"[{part} done at {time.perf_counter() - started:.0f} s]", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
