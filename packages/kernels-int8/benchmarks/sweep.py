"""INT8 sweep: the W8A8 GEMM over M on the Qwen2.5-3B shapes, end to end, and the quantizer.

Providers: cuBLAS fp16 and bf16 (``torch.matmul``), ``torch._int_mm`` alone and with an eager
rescale to fp16, ours (``matmul_int8`` on pre-quantized activations) and ours end to end
(``matmul_quantize_int8`` from fp16 activations). Writes ``results/<gpu>.csv`` (the shared
schema of ``llmsys.bench_harness``) and ``results/<gpu>.png``. Run
``python benchmarks/sweep.py --help``; the ``bench`` main job calls :func:`run`.

Times are GPU time per call (:func:`gpu_time_ms`: CUDA events around each call, L2 flushed by a
1 GiB write before it, which also gives the host a 0.3 ms head start, so Python launch cost does
not leak into the time); each provider's host cost per call is in the ``host`` rows.

Rooflines: the compute floor uses the measured bf16 matmul rate for fp16/bf16 providers and
twice it for int8 ones (the H100's dense int8 peak is twice its bf16 peak); the memory floor
uses the measured copy bandwidth and the bytes each provider must move at least.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import llmsys.bench_harness as harness
import llmsys.kernels_int8 as ki
from llmsys.kernels_int8 import reference

warmup = harness.load_beside(__file__, "warmup")

RESULTS = Path(__file__).parent / "results"
QWEN_SHAPES = [(2048, 6144), (2048, 2048), (2048, 22016), (11008, 2048)]  # (K, N) of one layer
GPU_M = [1, 16, 32, 64, 128, 256, 1024, 4096, 16384]
PREFILL_M, DECODE_M = 16384, (1, 16, 32)
GPU_QUANT = [(16, 2048), (1024, 2048), (8192, 2048), (16384, 2048), (4096, 4096), (16384, 11008)]
CPU_SHAPES, CPU_M, CPU_QUANT = [(64, 48)], [1, 16], [(16, 64)]
HOST_M = 1
REP_MS = 50
FLUSH_BYTES = 1 << 30


def gpu_time_ms(fn, device: str) -> tuple[float, float, float]:
    """(p20, p50, p80) GPU milliseconds of one call of ``fn``, 1 GiB flushed before each call
    (which keeps up to 0.35 ms of host cost per call out of the time on an H100)."""
    return harness.time_ms(fn, device=device, rep_ms=REP_MS, flush_bytes=FLUSH_BYTES)


def skipped(device: str) -> list[str]:
    """What this sweep leaves out on ``device``, and why."""
    notes = [
        "torchao's int8 dynamic-activation int8-weight linear: not in this sweep "
        "(`llmsys-bench serve` compares it where torchao is installed)",
    ]
    if device != "cuda":
        notes.append(
            "cuBLAS, torch._int_mm, bf16, the Qwen2.5-3B shapes and host-cost rows need a CUDA "
            "GPU (on CPU the Triton kernels run under the slow interpreter at tiny sizes)"
        )
    else:
        notes.append("torch._int_mm rows at M <= 16: _int_mm requires M > 16")
    return notes


def _row(kernel, provider, mode, x, dtype, times, *, work, unit, ceiling, baseline, config=""):
    """One CSV row; ``work`` (ops or bytes) per call gives the throughput, ``ceiling`` (the
    roofline floor in seconds) the fraction, ``baseline`` (ms) the speed-up."""
    return harness.row(
        kernel, provider, mode, x, dtype, times, work=work, throughput_unit=unit,
        floor_s=ceiling or None, baseline=baseline, config=config, **_META,
    )  # fmt: skip


_META = {"gpu": "", "version": ki.__version__, "timestamp": ""}  # filled by run()


def gemm_providers(m, n, k, device):
    """{name: (fn, dtype label, int8?)} for one (M, K) x (K, N) product, inputs prepared."""
    half = torch.float16 if device == "cuda" else torch.float32
    x = torch.randn(m, k, device=device, dtype=half)  # activations N(0, 1)
    w = torch.randn(n, k, device=device, dtype=half) * 0.02  # nn.Linear weight (N, K)
    q_w, w_scale = ki.quantize_int8(w.t())  # (K, N) column-major, (N,)
    q_x, x_scale = ki.quantize_int8_perrow(x)  # (M, K), (M,)
    found = {"cublas_fp16" if device == "cuda" else "torch_fp32": (lambda: x @ w.t(), "fp16")}
    if device == "cuda":
        xb, wb = x.bfloat16(), w.bfloat16()
        found["cublas_bf16"] = (lambda: xb @ wb.t(), "bf16")
        if m > 16:
            found["int_mm"] = (lambda: torch._int_mm(q_x, q_w), "int8")

            def int_mm_rescaled():
                acc = torch._int_mm(q_x, q_w)  # (M, N) int32
                return (acc.float() * x_scale.float()[:, None] * w_scale.float()[None, :]).half()

            found["int_mm_rescale"] = (int_mm_rescaled, "int8")
    found["ours"] = (lambda: ki.matmul_int8(q_x, x_scale, q_w, w_scale), "int8")
    found["ours_e2e"] = (lambda: ki.matmul_quantize_int8(x, q_w, w_scale), "int8")
    return found


def gemm_bytes(provider: str, m: int, n: int, k: int) -> int:
    if provider in ("cublas_fp16", "cublas_bf16", "torch_fp32"):
        return 2 * (m * k + k * n + m * n)
    if provider == "int_mm":
        return m * k + k * n + 4 * m * n
    if provider == "ours_e2e":  # read fp16 x, write q (re-read by the GEMM), weights, fp16 out
        return 2 * m * k + 2 * m * k + k * n + 2 * m * n
    return m * k + k * n + 2 * m * n  # ours, int_mm_rescale's ideal


def run(device: str = "cuda", *, quick: bool = False, progress=None) -> list[harness.Row]:
    """Time every provider on every case; speed-ups are relative to cuBLAS fp16 (GEMM) and
    the faster eager quantizer."""
    _META.update(gpu=harness.device_name(device), timestamp=harness.timestamp())
    on_gpu = device == "cuda"
    shapes, m_values = (QWEN_SHAPES, GPU_M) if on_gpu else (CPU_SHAPES, CPU_M)
    if quick:
        m_values = [m for m in m_values if m in (1, 16, PREFILL_M)] or m_values
    if on_gpu:
        failures = warmup.precompile(
            [(m, n, k, torch.float16) for m in m_values for k, n in shapes], workers=12
        )
        for line in failures:
            print("precompile:", line, file=sys.stderr)
    bandwidth = harness.copy_bandwidth(device)
    bf16_rate = harness.matmul_rate(device)
    rows = []
    for k, n in shapes:
        for m in m_values:
            rows += _gemm_rows(m, n, k, device, bandwidth, bf16_rate)
            if progress:
                progress()
    rows += _sum_rows(rows, shapes)
    rows += _quantize_rows(device, bandwidth, GPU_QUANT if on_gpu else CPU_QUANT)
    if on_gpu:
        rows += _host_rows(device)
    return rows


def _gemm_rows(m, n, k, device, bandwidth, bf16_rate) -> list[harness.Row]:
    rows = []
    baseline = None
    for name, (fn, dtype) in gemm_providers(m, n, k, device).items():
        times = gpu_time_ms(fn, device)
        int8 = dtype == "int8"
        ops_count = 2 * m * n * k
        floor = max(
            ops_count / (bf16_rate * (2 if int8 else 1)),
            gemm_bytes(name, m, n, k) / bandwidth,
        )
        baseline = baseline or times[1]  # the first provider: cuBLAS fp16 (fp32 on CPU)
        rows.append(
            _row(
                "w8a8_gemm",
                name,
                "e2e" if name == "ours_e2e" else "gemm",
                f"M={m} K={k} N={n}",
                dtype,
                times,
                work=ops_count,
                unit="TOP/s" if int8 else "TFLOP/s",
                ceiling=floor,
                baseline=baseline,
                config=_config(m, n, k) if name.startswith("ours") else "",
            )
        )
    return rows


def _config(m, n, k) -> str:
    from llmsys.kernels_int8 import tuning

    chosen = [str(c) for key, c in tuning._best.items() if key[:3] == (tuning.m_bucket(m), n, k)]
    return chosen[0] if chosen else "untuned: first candidate"


def _sum_rows(rows, shapes) -> list[harness.Row]:
    """Totals over the four shapes: prefill (M = 16384) and each decode M."""
    out = []
    gemm = [r for r in rows if r.kernel == "w8a8_gemm"]
    for m in sorted({int(r.x.split()[0][2:]) for r in gemm}):
        cases = [r for r in gemm if r.x.startswith(f"M={m} ")]
        providers = dict.fromkeys(r.provider for r in cases)
        totals = {}
        for p in providers:
            mine = [r for r in cases if r.provider == p]
            if len(mine) == len(shapes):
                totals[p] = [sum(getattr(r, q) for r in mine) for q in ("p20", "p50", "p80")]
        base = next(iter(totals.values()), None)
        for p, times in totals.items():
            ops_count = sum(2 * m * n * k for k, n in shapes)
            mine = [r for r in cases if r.provider == p]
            floor = sum(r.roofline_fraction * r.p50 * 1e-3 for r in mine)
            out.append(
                _row(
                    "w8a8_gemm",
                    p,
                    "sum4",
                    f"M={m} all shapes",
                    mine[0].dtype,
                    times,
                    work=ops_count,
                    unit=mine[0].throughput_unit,
                    ceiling=floor,
                    baseline=base[1],
                )
            )
    return out


def _quantize_rows(device, bandwidth, shapes) -> list[harness.Row]:
    rows = []
    half = torch.float16 if device == "cuda" else torch.float32
    for m, k in shapes:
        x = torch.randn(m, k, device=device, dtype=half)

        def eager_native(x=x):  # absmax, divide, round, cast in the input dtype
            scale = x.abs().amax(dim=1, keepdim=True) / 127
            return (x / scale).round().clamp(-127, 127).to(torch.int8), scale

        providers = {
            "eager_spec": lambda x=x: reference.quantize_int8_perrow_reference(x),
            "eager_native": eager_native,
            "ours": lambda x=x: ki.quantize_int8_perrow(x),
        }
        timed = {name: gpu_time_ms(fn, device) for name, fn in providers.items()}
        fastest_eager = min(timed["eager_spec"][1], timed["eager_native"][1])
        moved = m * k * (x.element_size() + 1) + m * x.element_size()
        for name, times in timed.items():
            rows.append(
                _row(
                    "quantize_int8_perrow",
                    name,
                    "quantize",
                    f"{m}x{k}",
                    str(half).removeprefix("torch."),
                    times,
                    work=moved,
                    unit="TB/s",
                    ceiling=moved / bandwidth,
                    baseline=fastest_eager,
                )
            )
    return rows


def _host_rows(device) -> list[harness.Row]:
    """Host cost of one decode call (M = 1, K = N = 2048), in a host-bound loop."""
    x = torch.randn(HOST_M, 2048, device=device, dtype=torch.float16)
    w = torch.randn(2048, 2048, device=device, dtype=torch.float16) * 0.02
    q_w, w_scale = ki.quantize_int8(w)
    q_x, x_scale = ki.quantize_int8_perrow(x)
    costs = {
        "cublas_fp16": harness.host_us_per_call(lambda: x @ w),
        "ours": harness.host_us_per_call(lambda: ki.matmul_int8(q_x, x_scale, q_w, w_scale)),
        "ours_quantize": harness.host_us_per_call(lambda: ki.quantize_int8_perrow(x)),
        "ours_e2e": harness.host_us_per_call(lambda: ki.matmul_quantize_int8(x, q_w, w_scale)),
        "ours_e2e_via_torch_ops": harness.host_us_per_call(
            lambda: torch.ops.llmsys.int8_matmul(
                *torch.ops.llmsys.int8_quantize_perrow(x), q_w, w_scale, None
            )
        ),
    }
    return [
        harness.row(
            "w8a8_gemm",
            name,
            "host",
            "M=1 K=2048 N=2048",
            "fp16",
            (us, us, us),
            unit="us",
            baseline=costs["cublas_fp16"],
            **_META,
        )
        for name, us in costs.items()
    ]


def plot(rows: list[harness.Row], path: Path) -> Path:
    """TOP/s against M for each Qwen shape, and the quantizer's TB/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gemm = [r for r in rows if r.mode in ("gemm", "e2e")]
    shapes = list(dict.fromkeys(r.x.split(" ", 1)[1] for r in gemm))
    fig, axes = plt.subplots(1, len(shapes) + 1, figsize=(4.5 * (len(shapes) + 1), 4))
    for ax, shape in zip(axes, shapes, strict=False):
        subset = [r for r in gemm if r.x.endswith(shape)]
        for provider in dict.fromkeys(r.provider for r in subset):
            points = [
                (int(r.x.split()[0][2:]), r.throughput) for r in subset if r.provider == provider
            ]
            ax.plot(*zip(*points, strict=True), marker="o", label=provider)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape}: T(FL)OP/s vs M")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    quant = [r for r in rows if r.kernel == "quantize_int8_perrow"]
    for provider in dict.fromkeys(r.provider for r in quant):
        mine = [r for r in quant if r.provider == provider]
        axes[-1].plot([r.x for r in mine], [r.throughput for r in mine], marker="o", label=provider)
    axes[-1].set_title("quantize: TB/s")
    axes[-1].tick_params(axis="x", rotation=45)
    axes[-1].legend(fontsize=7)
    axes[-1].grid(alpha=0.3)
    return harness.save_figure(
        fig, path, f"INT8 W8A8 on {rows[0].gpu}" if rows else "INT8 W8A8", dpi=110
    )


def main(argv: list[str] | None = None) -> None:
    harness.sweep_command(
        argv, __doc__, RESULTS, run, plot, quick_help="only M = 1, 16 and 16384", desc="int8 sweep"
    )


if __name__ == "__main__":
    main()
