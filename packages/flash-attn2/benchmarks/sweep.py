"""Attention sweep: naive, compiled naive, SDPA flash and cuDNN, ours, previous; fwd, bwd, fwd+bwd.

Causal attention (the CS336 assignment's sweep): batch 1, one head, seq 128 to 65536, d in
{16, 32, 64, 128}, bfloat16 and float32 (``--full``), plus the multi-head cases: 1x16x16384x64
(the assignment's leaderboard case), 4x16x4096x128, and the Hopper cases at batch 4, 32 heads:
forward+backward at 2048 and 8192 tokens, head dim 128, causal and not ("full"), with 32 or 8
kv heads (grouped-query, "kv8"), and the forward alone at head dims 64 and 128 from 2k to 16k
tokens. The default GPU run is a subset of the single-head grid that takes about two minutes
with the multi-head cases; ``--quick`` runs the multi-head cases only. An out-of-memory is a row
with config "OOM"; naive attention is left out where its scores would not fit (``skipped``).

Writes ``results/<gpu>.csv`` (the shared schema of ``llmsys.bench_harness``; throughput in TFLOP/s,
counting a forward as ``4 * B * H * N^2 * d``, halved when causal, and a backward as 2.5x that;
speed-up over SDPA's cuDNN backend where it ran, else SDPA flash's, else naive's) and
``results/<gpu>.png``. Run ``python benchmarks/sweep.py --help``; the ``bench`` main job calls
:func:`run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import llmsys.bench_harness as harness
import llmsys.flash_attn2 as fa
from llmsys.flash_attn2 import ops
from llmsys.triton_launch import forget

RESULTS = Path(__file__).parent / "results"
MODES = ("fwd", "bwd", "fwd_bwd")
LEADERBOARD = (1, 16, 16384, 64)  # causal bf16 fwd+bwd; target <= 5.36 ms
# Naive attention keeps the (B, H, N, N) scores: beyond the leaderboard case's (8 GiB in bf16)
# it takes minutes or runs out of memory, so larger cases leave it out.
NAIVE_MAX_SCORES = 16 * 16384**2


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem: q is ``shape`` (B, H, N, d), k and v have ``kv_heads`` heads (H if None)."""

    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    kv_heads: int | None = None
    causal: bool = True
    modes: tuple[str, ...] = MODES

    @property
    def label(self) -> str:
        """The CSV's x: the shape, then " kv<n>" for grouped-query heads, " full" without mask."""
        label = "x".join(map(str, self.shape))
        if self.kv_heads not in (None, self.shape[1]):
            label += f" kv{self.kv_heads}"
        return label if self.causal else label + " full"

    def fwd_flops(self) -> float:
        batch, heads, n, d = self.shape
        return 4.0 * batch * heads * n * n * d * (0.5 if self.causal else 1.0)

    def runs_naive(self) -> bool:
        batch, heads, n, _ = self.shape
        return batch * heads * n * n <= NAIVE_MAX_SCORES


def hopper_cases() -> list[Case]:
    """Issue 30's cases at batch 4, 32 heads, bf16 (the README's Hopper table)."""
    found = []
    for n in (2048, 8192):
        for causal in (True, False):
            for kv_heads in (32, 8):
                found.append(Case((4, 32, n, 128), torch.bfloat16, kv_heads, causal))
    for d in (64, 128):
        for n in (2048, 4096, 8192, 16384):
            if (d, n) not in ((128, 2048), (128, 8192)):  # those run fwd+bwd above
                found.append(Case((4, 32, n, d), torch.bfloat16, modes=("fwd",)))
    return found


def multi_head_cases() -> list[Case]:
    bf16 = torch.bfloat16
    return [Case(LEADERBOARD, bf16), Case((4, 16, 4096, 128), bf16), *hopper_cases()]


def full_grid() -> list[Case]:
    """The assignment's grid: every seq, head dim and dtype, one head, causal."""
    seqs = [2**p for p in range(7, 17)]
    return [
        Case((1, 1, n, d), dtype)
        for dtype in (torch.bfloat16, torch.float32)
        for d in (16, 32, 64, 128)
        for n in seqs
    ]


def default_grid() -> list[Case]:
    """A two-minute subset: every head dim, the longest sequence, both dtypes."""
    bf16 = [
        Case((1, 1, n, d), torch.bfloat16) for d in (64, 128) for n in (1024, 4096, 16384, 65536)
    ]
    small_d = [Case((1, 1, 4096, d), torch.bfloat16) for d in (16, 32)]
    fp32 = [Case((1, 1, n, d), torch.float32) for d in (64, 128) for n in (4096, 16384)]
    return bf16 + small_d + fp32


def cases(device: str, quick: bool, full: bool, dtype: torch.dtype | None = None) -> list[Case]:
    """The cases to time; ``dtype`` keeps only that dtype's cases."""
    if device != "cuda":
        found = [
            Case((1, 1, 64, 16), torch.float32),
            Case((1, 2, 128, 32), torch.float32),
            Case((1, 4, 96, 16), torch.float32, kv_heads=2, causal=False),
        ]
        found = found[: 1 if quick else 3]
    else:
        found = multi_head_cases()
        if not quick:
            found += full_grid() if full else default_grid()
    return [case for case in found if dtype in (None, case.dtype)]


# --- providers -----------------------------------------------------------------------------------


def naive_attention(q, k, v, causal: bool = True):
    """Attention with the scores in memory, in the inputs' dtype (the eager baseline); grouped
    kv heads are repeated to the query heads first."""
    n, d = q.shape[-2], q.shape[-1]
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # (B, H, N, N)
    if causal:
        rows, cols = torch.arange(n, device=q.device), torch.arange(n, device=q.device)
        scores = torch.where(rows[:, None] >= cols[None, :], scores, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v, causal: bool = True):
        with sdpa_kernel(backend):
            gqa = k.shape[1] != q.shape[1]
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return attention


def ours(q, k, v, causal: bool = True):
    return fa.flash_attention(q, k, v, causal=causal)


@contextlib.contextmanager
def previous_forward():
    """The ``previous`` provider is ours with the forward kernel of 0.1 (pointer loads, no TMA),
    set for the block: the regression check. The ops' recorded replays are forgotten when the
    switch changes, as they launch the kernel they were recorded with."""
    current = ops.FORWARD_KERNEL
    ops.FORWARD_KERNEL = "pointer"
    forget(ops.flash_attn2_fwd)
    try:
        yield
    finally:
        ops.FORWARD_KERNEL = current
        forget(ops.flash_attn2_fwd)


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


def providers(device: str, case: Case, full: bool) -> dict:
    """The providers of ``case``: naive where its scores fit, compiled naive on the leaderboard
    case (every case with ``--full``), SDPA's backends on CUDA, ours, previous."""
    found = {"naive": naive_attention} if case.runs_naive() else {}
    if device == "cuda":
        from torch.nn.attention import SDPBackend

        if case.runs_naive() and (full or case.shape == LEADERBOARD):
            found["compile"] = compiled_naive_attention()
        found["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        found["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    found["ours"] = ours
    if device == "cuda":
        found["previous"] = ours  # under previous_forward()
    return found


def skipped(device: str) -> list[str]:
    """What this sweep leaves out on ``device``, and why."""
    if device != "cuda":
        return [
            "SDPA flash/cuDNN, torch.compile and every case beyond the three CPU cases need a "
            "CUDA GPU (on CPU the Triton kernels run under the slow interpreter)"
        ]
    return [
        "default run: the single-head grid is a subset (python benchmarks/sweep.py --full runs "
        "all 80 cells); torch.compile'd naive attention runs on the leaderboard case only",
        "naive attention (and its compiled form) leaves out the cases whose (B, H, N, N) scores "
        "exceed the leaderboard case's: minutes per call, or out of memory",
    ]


# --- measurement ---------------------------------------------------------------------------------


FLOPS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def time_provider(fn, case: Case, device: str) -> dict[str, tuple | str]:
    """{mode: (p20, p50, p80) in ms, or why it did not run ("OOM", "unsupported: ...")}."""
    results = {}
    try:
        _time_modes(fn, case, device, results)
    except torch.cuda.OutOfMemoryError:
        results = {mode: results.get(mode, "OOM") for mode in case.modes}
    except RuntimeError as error:  # e.g. SDPA: no kernel for float32 or this head dim
        reason = "unsupported: " + str(error).splitlines()[0][:80]
        results = {mode: results.get(mode, reason) for mode in case.modes}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def _time_modes(fn, case: Case, device: str, results: dict) -> None:
    batch, _, n, d = case.shape
    kv_shape = (batch, case.kv_heads or case.shape[1], n, d)
    q = torch.randn(case.shape, device=device, dtype=case.dtype)
    k, v = (torch.randn(kv_shape, device=device, dtype=case.dtype) for _ in "kv")
    causal = case.causal
    with torch.no_grad():
        results["fwd"] = harness.time_ms(lambda: fn(q, k, v, causal), device=device)
    if "fwd_bwd" not in case.modes:
        return
    grad_out = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def forward_backward():
        fn(*leaves, causal).backward(grad_out)

    results["fwd_bwd"] = harness.time_ms(forward_backward, device=device, grad_to_none=leaves)
    out = fn(*leaves, causal)
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
    """Rows case by case; speed-up is SDPA cuDNN's time (else SDPA flash's, else naive's) over
    the time."""
    gpu, stamp = harness.device_name(device), harness.timestamp()
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 naive attention gets TF32 too
    for case in cases(device, quick, full, only_dtype):
        timings = {}
        for name, fn in providers(device, case, full).items():
            with previous_forward() if name == "previous" else contextlib.nullcontext():
                timings[name] = time_provider(fn, case, device)
        rate = ceiling(device, case.dtype)
        rows = []
        for mode in case.modes:
            base = next(
                (
                    timings[name][mode]
                    for name in ("sdpa_cudnn", "sdpa_flash", "naive")
                    if isinstance(timings.get(name, {}).get(mode), tuple)
                ),
                None,
            )
            for name, results in timings.items():
                rows.append(make_row(name, mode, case, results[mode], base, rate, gpu, stamp))
        yield rows


def run(device: str = "cuda", *, quick: bool = False, progress=None, full: bool = False):
    """Time every provider on every case (the ``bench`` main job's entry point)."""
    rows = []
    for case_rows in iter_rows(device, quick, full):
        rows += case_rows
        if progress:
            progress()
    return rows


def make_row(name, mode, case: Case, result, base, rate, gpu, stamp) -> harness.Row:
    """One row; ``result`` is (p20, p50, p80) or what stopped the run ("OOM": NaN times)."""
    timed = isinstance(result, tuple)
    flops = case.fwd_flops() * FLOPS_FACTOR[mode]
    return harness.row(
        "flash_attention", name, mode, case.label, case.dtype,
        result if timed else (math.nan,) * 3,
        work=flops if timed else None, throughput_unit="TFLOP/s",
        floor_s=flops / rate if timed else None,
        baseline=base[1] if timed and base is not None else None,
        config=(our_config(case.shape, case.dtype) if name == "ours" else "") if timed else result,
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


def _dims(row: harness.Row) -> list[int]:
    """(B, H, N, d) of a row's x ("4x32x8192x128 kv8 full" -> [4, 32, 8192, 128])."""
    return [int(part) for part in row.x.split(" ")[0].split("x")]


def _lines(ax, rows: list[harness.Row], title: str) -> None:
    """TFLOP/s against sequence length, one line per provider."""
    for provider in dict.fromkeys(r.provider for r in rows):
        points = sorted((_dims(r)[2], r.throughput) for r in rows if r.provider == provider)
        ax.plot(*zip(*points, strict=True), marker="o", label=provider, color=COLORS.get(provider))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _bars(ax, rows: list[harness.Row], title: str) -> None:
    """TFLOP/s per case, one bar per provider."""
    labels = list(dict.fromkeys(r.x for r in rows))
    names = list(dict.fromkeys(r.provider for r in rows))
    width = 0.8 / max(len(names), 1)
    for i, provider in enumerate(names):
        by_label = {r.x: r.throughput for r in rows if r.provider == provider}
        xs = [j + i * width for j in range(len(labels))]
        heights = [by_label.get(label, 0) for label in labels]
        ax.bar(xs, heights, width, label=provider, color=COLORS.get(provider))
    ticks = [label.replace(" ", "\n") for label in labels]
    ax.set_xticks([j + 0.4 for j in range(len(labels))], ticks, fontsize=6)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


def plot(rows: list[harness.Row], path: Path) -> Path:
    """TFLOP/s: causal fwd+bwd against sequence length per (dtype, head dim) with one head; the
    multi-head fwd+bwd cases as bars; the B=4, H=32 causal forward against sequence length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.throughput]
    single = [r for r in timed if r.x.startswith("1x1x") and r.mode == "fwd_bwd"]
    multi = [r for r in timed if not r.x.startswith("1x1x")]
    panels = [
        (_lines, [r for r in single if r.dtype == dtype and _dims(r)[3] == d],
         f"{dtype} d={d}, one head, causal fwd+bwd TFLOP/s")
        for dtype, d in sorted({(r.dtype, _dims(r)[3]) for r in single})
    ]  # fmt: skip
    both = [r for r in multi if r.mode == "fwd_bwd"]
    if both:
        panels.append((_bars, both, "multi-head fwd+bwd, bf16, TFLOP/s"))
    for d in sorted({_dims(r)[3] for r in multi if _dims(r)[:2] == [4, 32]}):
        forward = [
            r
            for r in multi
            if r.mode == "fwd" and r.x == "x".join(map(str, (4, 32, _dims(r)[2], d)))
        ]  # causal, 32 kv heads: the label is the bare shape
        if forward:
            panels.append((_lines, forward, f"forward, 4x32xNx{d} bf16 causal, TFLOP/s"))
    columns = 4
    widths = [2 if draw is _bars else 1 for draw, _, _ in panels]  # the bars get two columns
    places, column, line = [], 0, 0  # (grid row, first column, width) of each panel
    for width in widths:
        if column + width > columns:
            column, line = 0, line + 1
        places.append((line, column, width))
        column += width
    fig = plt.figure(figsize=(4.5 * columns, 3.8 * (line + 1)))
    grid = fig.add_gridspec(line + 1, columns)
    for (draw, subset, title), (at_row, at_column, width) in zip(panels, places, strict=True):
        draw(fig.add_subplot(grid[at_row, at_column : at_column + width]), subset, title)
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
