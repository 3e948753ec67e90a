"""GPU exploration: candidate tile configurations of each kernel at the target shapes.

For 1x16x16384x{32,64} and 4x16x4096x128 (causal, bf16) it compiles every candidate in parallel
worker processes (filling Triton's cache), then times each kernel with the others at their
defaults: the forward with ``do_bench``, the two backward kernels from profiler kernel times.
Each candidate's gradients are checked against SDPA's. Last, the best of each kernel together
against SDPA flash and cuDNN (the sweep's own timing code). Results feed ``ops._CONFIGS_16BIT``
and ``NOTES.md``. Usage: ``python benchmarks/explore.py [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

CASES = {32: (1, 16, 16384, 32), 64: (1, 16, 16384, 64), 128: (4, 16, 4096, 128)}
# --smoke: the logic on CPU, no timing
SMOKE_CASES = {32: (1, 1, 33, 32), 64: (1, 2, 48, 64), 128: (1, 1, 40, 128)}
DEVICE = "cuda"
# (block_m, block_n, num_warps, num_stages[, head_major]) per kernel and head dim; the first is
# the default (ops' table). Round 4 (NOTES.md section 5) tries each kernel's best shapes of
# rounds 1-3 in both program orders (head_major True: all tiles of a head, then the next head).
CANDIDATES = {
    32: {
        "fwd": [(128, 128, 4, 3), (128, 128, 4, 3, True)],
        "dkdv": [(32, 128, 4, 3), (32, 128, 4, 3, True), (64, 128, 4, 3, True)],
        "dq": [(64, 64, 4, 3), (64, 64, 4, 3, True)],
    },
    64: {  # rounds 5 and 6: the dK/dV choice again, with 2-D grids, then 1-D head-major grids
        "fwd": [(128, 64, 4, 3)],
        "dkdv": [(64, 64, 4, 3, True), (64, 64, 4, 2, True), (32, 64, 4, 4), (64, 64, 4, 3)],
        "dq": [(64, 64, 4, 3)],
    },
    128: {
        "fwd": [(128, 64, 8, 3, True), (128, 64, 8, 3)],
        "dkdv": [(32, 64, 4, 3), (32, 64, 4, 3, True), (32, 64, 4, 2), (32, 64, 4, 2, True)],
        "dq": [(64, 64, 4, 2, True), (64, 64, 4, 2)],
    },
}  # fmt: skip
KERNELS = ("fwd", "dkdv", "dq")


def patch_configs(d: int, chosen: dict) -> None:
    """Make ops.tile_configs return ``chosen`` kernels' configs, the first candidates otherwise."""
    from llmsys.flash_attn2 import ops

    configs = tuple(
        ops.TileConfig(*chosen.get(kernel, CANDIDATES[d][kernel][0])) for kernel in KERNELS
    )
    ops.tile_configs = lambda *args: configs


def inputs(shape, device="cuda"):
    return [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(4)]


def warm(task) -> tuple:
    """Worker: compile one candidate on a small problem of the same specialization."""
    d, kernel, config, device = task
    from llmsys.flash_attn2 import ops

    patch_configs(d, {kernel: config})
    q, k, v, grad_out = inputs((1, 2, 512 if device == "cuda" else 20, d), device)
    started = time.perf_counter()
    try:
        out, lse = ops.flash_attn2_fwd_impl(q, k, v, True, d**-0.5)
        if kernel != "fwd":
            ops.flash_attn2_bwd_impl(grad_out, q, k, v, out, lse, True, d**-0.5)
        if device == "cuda":
            torch.cuda.synchronize()
        return task, time.perf_counter() - started, ""
    except Exception as error:  # out of shared memory, ...
        return task, time.perf_counter() - started, str(error).splitlines()[0][:120]


def kernel_times_ms(fn, names, repeats=10) -> dict:
    """Mean device time of each kernel whose name contains one of ``names`` (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE != "cuda":
        return dict.fromkeys(names, 0.0)
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        for name in names:
            if name in event.key:
                times[name] = times.get(name, 0.0) + total / 1000 / repeats
    return times


def relative_error(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def explore_case(d: int, log) -> dict:
    import triton.testing

    from llmsys.flash_attn2 import ops

    shape = CASES[d]
    q, k, v, grad_out = inputs(shape, DEVICE)
    scale = d**-0.5
    ref = [t.detach().requires_grad_() for t in (q, k, v)]
    ref_out = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    ref_grads = torch.autograd.grad(ref_out, ref, grad_out)
    best = {}
    for kernel in KERNELS:
        timings = []
        for config in CANDIDATES[d][kernel]:
            patch_configs(d, {kernel: config})
            try:
                out, lse = ops.flash_attn2_fwd_impl(q, k, v, True, scale)
                grads = ops.flash_attn2_bwd_impl(grad_out, q, k, v, out, lse, True, scale)
                errors = [relative_error(out, ref_out)] + [
                    relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)
                ]
                if DEVICE != "cuda":
                    ms = 0.0
                elif kernel == "fwd":
                    ms = triton.testing.do_bench(
                        lambda: ops.flash_attn2_fwd_impl(q, k, v, True, scale), warmup=25, rep=100
                    )
                else:
                    name = {"dkdv": "attn_bwd_dkdv_kernel", "dq": "attn_bwd_dq_kernel"}[kernel]
                    ms = kernel_times_ms(
                        lambda: ops.flash_attn2_bwd_impl(grad_out, q, k, v, out, lse, True, scale),
                        [name],
                    )[name]
            except Exception as error:
                log(f"  d={d} {kernel} {config}: FAILED {str(error).splitlines()[0][:100]}")
                continue
            timings.append((ms, config))
            log(
                f"  d={d} {kernel:4} {config}: {ms:7.3f} ms  rel.err out/dq/dk/dv "
                + " ".join(f"{e:.1e}" for e in errors)
            )
        timings.sort()
        best[kernel] = timings[0][1]
        log(f"d={d} best {kernel}: {timings[0][1]} at {timings[0][0]:.3f} ms")
    return best


def compare(d: int, best: dict, log) -> dict:
    """The best configs together against SDPA flash and cuDNN, with the sweep's timing code."""
    import sweep
    from torch.nn.attention import SDPBackend

    patch_configs(d, best)
    shape = CASES[d]
    summary = {}
    for name, fn in [
        ("sdpa_flash", sweep.sdpa(SDPBackend.FLASH_ATTENTION)),
        ("sdpa_cudnn", sweep.sdpa(SDPBackend.CUDNN_ATTENTION)),
        ("ours", sweep.ours),
    ]:
        results = sweep.time_provider(fn, shape, torch.bfloat16, DEVICE)
        summary[name] = {mode: r[1] if isinstance(r, tuple) else r for mode, r in results.items()}
        cells = []
        for mode in sweep.MODES:
            ms = summary[name][mode]
            if isinstance(ms, float):
                tflops = sweep.causal_fwd_flops(shape) * sweep.FLOPS_FACTOR[mode] / ms / 1e9
                cells.append(f"{mode} {ms:.3f} ms ({tflops:.0f} TFLOP/s)")
            else:
                cells.append(f"{mode} {ms}")
        log(f"{'x'.join(map(str, shape))} {name:10} " + "  ".join(cells))
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("explore-out"))
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny cases on CPU, no timing")
    parser.add_argument("--dims", type=int, nargs="*", help="only these head dims (default: all)")
    args = parser.parse_args(argv)
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        CASES.update(SMOKE_CASES)
    for d in set(CASES) - set(args.dims or CASES):
        del CASES[d]
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "explore.log").open("w")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    started = time.perf_counter()
    tasks = [
        (d, kernel, config, DEVICE)
        for d in CASES
        for kernel in KERNELS
        for config in CANDIDATES[d][kernel]
    ]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        for (d, kernel, config, _), seconds, error in pool.imap_unordered(warm, tasks):
            log(f"compiled d={d} {kernel} {config} in {seconds:.1f} s {error}")
    log(f"precompile: {time.perf_counter() - started:.0f} s")
    report = {}
    for d in CASES:
        best = explore_case(d, log)
        report[d] = {"best": best, "summary": compare(d, best, log)}
        log(f"elapsed {time.perf_counter() - started:.0f} s")
    (args.out / "explore.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
