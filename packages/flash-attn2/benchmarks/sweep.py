"""Attention sweep: naive, compiled naive, SDPA flash and cuDNN, ours, previous; fwd, bwd, fwd+bwd.

Causal attention (the CS336 assignment's sweep): batch 1, one head, seq 128 to 65536, d in
{16, 32, 64, 128}, bfloat16 and float32 (``--full``), plus the multi-head cases 1x16x16384x64 (the
assignment's leaderboard case) and 4x16x4096x128. The default GPU run is a subset that takes about
two minutes and always includes the multi-head cases. An out-of-memory is a row with config "OOM".

Writes ``results/<gpu>.csv`` (the shared schema of ``llmsys.bench_harness``; throughput in TFLOP/s,
counting causal forward as ``2 * B * H * N^2 * d`` and backward as 2.5x that) and
``results/<gpu>.png``. Run ``python benchmarks/sweep.py --help``; the ``bench`` main job calls
:func:`run`.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import llmsys.bench_harness as harness
import llmsys.flash_attn2 as fa
from llmsys.flash_attn2 import ops

RESULTS = Path(__file__).parent / "results"
MODES = ("fwd", "bwd", "fwd_bwd")
MULTI_HEAD = [(1, 16, 16384, 64), (4, 16, 4096, 128)]  # (batch, heads, seq, head_dim)
LEADERBOARD = (1, 16, 16384, 64)  # causal bf16 fwd+bwd; target <= 5.36 ms


def full_grid() -> list[tuple]:
    """The assignment's grid: (shape, dtype) for every seq, head dim and dtype."""
    seqs = [2**p for p in range(7, 17)]
    return [
        ((1, 1, n, d), dtype)
        for dtype in (torch.bfloat16, torch.float32)
        for d in (16, 32, 64, 128)
        for n in seqs
    ]


def default_grid() -> list[tuple]:
    """A two-minute subset: every head dim, the longest sequence, both dtypes."""
    bf16 = [((1, 1, n, d), torch.bfloat16) for d in (64, 128) for n in (1024, 4096, 16384, 65536)]
    small_d = [((1, 1, 4096, d), torch.bfloat16) for d in (16, 32)]
    fp32 = [((1, 1, n, d), torch.float32) for d in (64, 128) for n in (4096, 16384)]
    return bf16 + small_d + fp32


def cases(device: str, quick: bool, full: bool, dtype: torch.dtype | None = None) -> list[tuple]:
    """(shape, dtype) to time; ``dtype`` keeps only that dtype's cases."""
    if device != "cuda":
        found = [((1, 1, 64, 16), torch.float32), ((1, 2, 128, 32), torch.float32)]
        found = found[: 1 if quick else 2]
    else:
        found = [(shape, torch.bfloat16) for shape in MULTI_HEAD]
        if not quick:
            found += full_grid() if full else default_grid()
    return [case for case in found if dtype in (None, case[1])]


# --- providers -----------------------------------------------------------------------------------


def naive_attention(q, k, v):
    """Causal attention with the scores in memory, in the inputs' dtype (the eager baseline)."""
    n, d = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, N, N)
    keep = torch.arange(n, device=q.device)[:, None] >= torch.arange(n, device=q.device)[None, :]
    scores = torch.where(keep, scores, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return attention


def ours(q, k, v):
    return fa.flash_attention(q, k, v, causal=True)


_previous_plans: dict = {}  # the previous provider's own plans (ops keys them by problem only)


def previous(q, k, v, causal: bool = True):
    """Ours with the forward kernel of 0.1 (pointer loads, no TMA): the regression check."""
    current, plans = ops.FORWARD_KERNEL, ops._forward_plans
    ops.FORWARD_KERNEL, ops._forward_plans = "pointer", _previous_plans
    try:
        return fa.flash_attention(q, k, v, causal=causal)
    finally:
        ops.FORWARD_KERNEL, ops._forward_plans = current, plans


@functools.cache
def compiled_naive_attention():
    """``torch.compile``'d naive attention, compiled once per dtype for every sequence length.

    ``dynamic=True``: one compile serves the whole grid (a static compile per cell would take
    most of the sweep's time; the naive graph is cuBLAS matmuls around a memory-bound softmax,
    where static shapes gain little). The recompile limit is raised so that a recompile never
    falls back to eager silently.
    """
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(naive_attention, dynamic=True)


def providers(device: str, with_compile: bool) -> dict:
    found = {"naive": naive_attention}
    if device == "cuda":
        from torch.nn.attention import SDPBackend

        if with_compile:
            found["compile"] = compiled_naive_attention()
        found["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        found["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    found["ours"] = ours
    if device == "cuda":
        found["previous"] = previous
    return found


def skipped(device: str) -> list[str]:
    """What this sweep leaves out on ``device``, and why."""
    if device != "cuda":
        return [
            "SDPA flash/cuDNN, torch.compile and every size above 1x2x128x32 need a CUDA GPU "
            "(on CPU the Triton kernels run under the slow interpreter)"
        ]
    return [
        "default run: the single-head grid is a subset (python benchmarks/sweep.py --full runs "
        "all 80 cells); torch.compile'd naive attention runs on the leaderboard case only"
    ]


# --- measurement ---------------------------------------------------------------------------------


def causal_fwd_flops(shape) -> float:
    batch, heads, n, d = shape
    return 2.0 * batch * heads * n * n * d  # 4 * B * H * N^2 * d, halved by the causal mask


FLOPS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def time_provider(fn, shape, dtype, device) -> dict[str, tuple | str]:
    """{mode: (p20, p50, p80) in ms, or why it did not run ("OOM", "unsupported: ...")}."""
    results = {}
    try:
        _time_modes(fn, shape, dtype, device, results)
    except torch.cuda.OutOfMemoryError:
        results = {mode: results.get(mode, "OOM") for mode in MODES}
    except RuntimeError as error:  # e.g. SDPA: no kernel for float32 or this head dim
        reason = "unsupported: " + str(error).splitlines()[0][:80]
        results = {mode: results.get(mode, reason) for mode in MODES}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def _time_modes(fn, shape, dtype, device, results: dict) -> None:
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        results["fwd"] = harness.time_ms(lambda: fn(q, k, v), device=device)

    def forward_backward():
        fn(*leaves).backward(grad_out)

    results["fwd_bwd"] = harness.time_ms(forward_backward, device=device, grad_to_none=leaves)
    out = fn(*leaves)
    try:
        results["bwd"] = harness.time_ms(
            lambda: out.backward(grad_out, retain_graph=True), device=device, grad_to_none=leaves
        )
    except RuntimeError:  # a compiled graph may refuse retain_graph: time the difference
        fwd, both = results["fwd"], results["fwd_bwd"]
        results["bwd"] = tuple(b - f for f, b in zip(fwd, both, strict=True))


def ceiling(device: str, dtype: torch.dtype) -> float:
    """The matmul rate our dots compete with: bf16 tensor cores, or TF32 for float32 inputs."""
    if dtype != torch.float32 or device != "cuda":
        return harness.matmul_rate(device, torch.bfloat16 if device == "cuda" else dtype)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return harness.matmul_rate(device, torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def our_config(shape, dtype) -> str:
    fwd, dkdv, dq = ops.tile_configs(shape[-1], dtype)
    return " ".join(
        f"{name}={c.block_m}x{c.block_n}/w{c.num_warps}/s{c.num_stages}{'/hm' * c.head_major}"
        for name, c in (("fwd", fwd), ("dkdv", dkdv), ("dq", dq))
    )


def iter_rows(device: str, quick: bool, full: bool, only_dtype: torch.dtype | None = None):
    """Rows case by case; speed-up is SDPA flash's time (else naive's) over the time."""
    gpu, stamp = harness.device_name(device), harness.timestamp()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 naive attention gets TF32 too
    for shape, dtype in cases(device, quick, full, only_dtype):
        with_compile = full or shape == LEADERBOARD
        timings = {
            name: time_provider(fn, shape, dtype, device)
            for name, fn in providers(device, with_compile).items()
        }
        rate = ceiling(device, dtype)
        rows = []
        for mode in MODES:
            base = timings.get("sdpa_flash", {}).get(mode)
            if not isinstance(base, tuple):
                base = timings["naive"][mode]
            for name, results in timings.items():
                rows.append(
                    make_row(name, mode, shape, dtype, results[mode], base, rate, gpu, stamp)
                )
        yield rows


def run(device: str = "cuda", *, quick: bool = False, progress=None, full: bool = False):
    """Time every provider on every case (the ``bench`` main job's entry point)."""
    rows = []
    for case_rows in iter_rows(device, quick, full):
        rows += case_rows
        if progress:
            progress()
    return rows


def make_row(name, mode, shape, dtype, result, base, rate, gpu, stamp) -> harness.Row:
    """One row; ``result`` is (p20, p50, p80) or what stopped the run ("OOM": NaN times)."""
    timed = isinstance(result, tuple)
    flops = causal_fwd_flops(shape) * FLOPS_FACTOR[mode]
    return harness.row(
        "flash_attention", name, mode, "x".join(map(str, shape)), dtype,
        result if timed else (math.nan,) * 3,
        work=flops if timed else None, throughput_unit="TFLOP/s",
        floor_s=flops / rate if timed else None,
        baseline=base[1] if timed and isinstance(base, tuple) else None,
        config=(our_config(shape, dtype) if name == "ours" else "") if timed else result,
        gpu=gpu, version=fa.__version__, timestamp=stamp,
    )  # fmt: skip


# --- report --------------------------------------------------------------------------------------


def report_rows(rows: list[harness.Row]) -> list[harness.Row]:
    """The report's table: the multi-head cases, and fwd+bwd of one head at 16384 and 65536."""
    return [
        r
        for r in rows
        if not r.x.startswith("1x1x")
        or (r.mode == "fwd_bwd" and r.x.split("x")[2] in ("16384", "65536"))
    ]


COLORS = {
    "naive": "C7",
    "compile": "C1",
    "sdpa_flash": "C0",
    "sdpa_cudnn": "C2",
    "ours": "C3",
    "previous": "C4",
}


def plot(rows: list[harness.Row], path: Path) -> Path:
    """TFLOP/s against sequence length per (dtype, head dim), and the multi-head cases."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.throughput]
    single = [r for r in timed if r.x.startswith("1x1x") and r.mode == "fwd_bwd"]
    panels = sorted({(r.dtype, int(r.x.split("x")[3])) for r in single})
    columns = 4
    n_rows = math.ceil((len(panels) + 1) / columns)
    fig, axes = plt.subplots(n_rows, columns, figsize=(4.5 * columns, 3.8 * n_rows), squeeze=False)
    axes = axes.ravel()
    for ax, (dtype, d) in zip(axes, panels, strict=False):
        subset = [r for r in single if r.dtype == dtype and r.x.endswith(f"x{d}")]
        for provider in dict.fromkeys(r.provider for r in subset):
            points = sorted(
                (int(r.x.split("x")[2]), r.throughput) for r in subset if r.provider == provider
            )
            ax.plot(
                *zip(*points, strict=True), marker="o", label=provider, color=COLORS.get(provider)
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_title(f"{dtype} d={d}, causal fwd+bwd TFLOP/s", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[len(panels)]
    multi = [r for r in timed if not r.x.startswith("1x1x")]
    labels = list(dict.fromkeys(f"{r.x}\n{r.mode}" for r in multi))
    names = list(dict.fromkeys(r.provider for r in multi))
    width = 0.8 / max(len(names), 1)
    for i, provider in enumerate(names):
        by_label = {f"{r.x}\n{r.mode}": r.throughput for r in multi if r.provider == provider}
        xs = [j + i * width for j in range(len(labels))]
        heights = [by_label.get(label, 0) for label in labels]
        ax.bar(xs, heights, width, label=provider, color=COLORS.get(provider))
    ax.set_xticks([j + 0.4 for j in range(len(labels))], labels, fontsize=6)
    ax.set_title("multi-head, bf16 causal, TFLOP/s", fontsize=9)
    ax.legend(fontsize=7)
    for ax in axes[len(panels) + 1 :]:
        ax.axis("off")
    return harness.save_figure(
        fig, path, f"FlashAttention-2 on {rows[0].gpu}" if rows else "FlashAttention-2", dpi=100
    )


def main(argv: list[str] | None = None) -> None:
    parser = harness.sweep_arguments(
        __doc__.splitlines()[0], RESULTS, quick_help="only the multi-head cases"
    )
    parser.add_argument("--full", action="store_true", help="the whole assignment grid (long)")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="only this dtype's cases (a full run split in two; merge the CSVs, then --replot)",
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    partial_csv = args.out / f"{harness.device_slug(args.device)}.csv"

    def run_keeping_rows(progress) -> list[harness.Row]:
        rows = []
        for case_rows in iter_rows(args.device, args.quick, args.full, dtype):
            rows += case_rows
            harness.write_csv(rows, partial_csv)  # a cut-short run keeps its rows
            progress()
        return rows

    total = len(cases(args.device, args.quick, args.full, dtype))
    harness.sweep_main(args, plot, run_keeping_rows, desc="attention sweep", total=total)


if __name__ == "__main__":
    main()
