"""One timer, one roofline and one CSV schema for every package's benchmarks.

Each row of a results CSV is one (kernel, provider, mode, case): its p20/p50/p80 times, the
throughput they imply, and that throughput as a fraction of the measured device ceiling (copy
bandwidth for memory-bound ops, the bf16 matmul rate for compute-bound ones).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from . import arguments
from .results import (
    CSV_FIELDS,
    Row,
    device_name,
    device_slug,
    markdown_table,
    quantiles,
    read_csv,
    read_rows,
    timestamp,
    write_csv,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "CSV_FIELDS",
    "Row",
    "call_times_ms",
    "copy_bandwidth",
    "cuda_graph",
    "device_name",
    "device_slug",
    "host_us_per_call",
    "host_us_side_by_side",
    "load_beside",
    "matmul_rate",
    "plot_or_say_why_not",
    "plot_vs_baseline",
    "progress_bar",
    "read_csv",
    "read_rows",
    "replot",
    "row",
    "save_figure",
    "sweep_arguments",
    "sweep_command",
    "sweep_main",
    "time_ms",
    "time_ms_side_by_side",
    "timestamp",
    "torchrun",
    "write_csv",
]


def time_ms(
    fn: Callable[[], object],
    *,
    device: str | torch.device = "cuda",
    grad_to_none: Iterable[torch.Tensor] | None = None,
    rep_ms: int = 100,
    flush_bytes: int | None = None,
    flush_by: str = "write",
) -> tuple[float, float, float]:
    """(p20, p50, p80) of one call of ``fn`` in milliseconds.

    On CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between calls, warm-up first),
    or with ``flush_bytes`` a flush of that many bytes before every call instead of do_bench's
    256 MB write. A larger flush keeps the GPU busy while the host enqueues the call (1 GiB:
    about 0.35 ms on an H100), so up to that much host cost per call stays out of the time.
    ``flush_by`` is how: "write" (as do_bench) leaves L2 full of dirty lines, whose write-back
    the timed call then pays as it reads; "read" leaves it holding clean, useless lines, the
    state a layer of a model meets after the layer before read its weights. A memory-bound
    call reading tens of MB is 10-20% slower after a write (the decode GEMM on an H100).
    On CPU: wall clock over repeated calls after a warm-up, for smoke runs only (no flush).

    Raises:
        ValueError: ``flush_by`` is not "write" or "read".
    """
    if flush_by not in ("write", "read"):
        raise ValueError(f"flush_by must be 'write' or 'read', got {flush_by!r}")
    if torch.device(device).type == "cuda":
        if flush_bytes is not None:
            times = _flushed_turns([fn], device, grad_to_none, rep_ms, flush_bytes, flush_by)
            return times[0]
        import triton.testing

        p20, p50, p80 = triton.testing.do_bench(
            fn, warmup=25, rep=rep_ms, quantiles=[0.2, 0.5, 0.8], grad_to_none=grad_to_none
        )
        return p20, p50, p80
    fn()
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1000
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 100):
        _clear_grads(grad_to_none)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return quantiles(samples)


def call_times_ms(
    fn: Callable[[], object], *, reps: int, warmup: int = 0, device: str | torch.device = "cuda"
) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    Unlike :func:`time_ms`, nothing is flushed and the calls are issued back to back, so the time
    a host takes to enqueue a call counts, as in a serving or training loop. On CUDA: events
    around each call; elsewhere the host clock.
    """
    _check_calls(fn, reps=(reps, 1), warmup=(warmup, 0))
    for _ in range(warmup):
        fn()
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    torch.cuda.synchronize(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for begin, finish in events:
        begin.record()
        fn()
        finish.record()
    torch.cuda.synchronize(device)
    return [begin.elapsed_time(finish) for begin, finish in events]


def cuda_graph(fn: Callable[[], object], *, calls: int = 1, warmup: int = 3) -> Callable[[], None]:
    """``calls`` calls of ``fn`` captured in one CUDA graph; returns its ``replay``.

    ``warmup`` calls run first on a side stream (compiling, tuning and allocating outside the
    capture, as torch's CUDA-graph notes ask). ``fn`` must be capturable: no host sync, and its
    inputs and outputs at fixed addresses (a replay rewrites the same output tensors).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``calls`` is not an int >= 1 or ``warmup`` not an int >= 0.
        RuntimeError: there is no CUDA device.
    """
    _check_calls(fn, calls=(calls, 1), warmup=(warmup, 0))
    if not torch.cuda.is_available():
        raise RuntimeError("cuda_graph needs a CUDA device; torch.cuda.is_available() is False")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def _check_calls(fn: object, **counts: tuple[int, int]) -> None:
    """TypeError unless ``fn`` is callable; ValueError unless each count is an int >= its least."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    for name, (value, least) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _clear_grads(tensors: Iterable[torch.Tensor] | None) -> None:
    for t in tensors or ():
        t.grad = None


def time_ms_side_by_side(
    fns: Sequence[Callable[[], object]],
    *,
    rep_ms: int = 200,
    flush_bytes: int = 2**30,
    flush_by: str = "read",
    device: str | torch.device = "cuda",
) -> list[tuple[float, float, float]]:
    """(p20, p50, p80) of one call of each of ``fns`` in milliseconds, their calls taking turns.

    On CUDA, rounds of one call of each fn, in the reverse order every other round, each call
    after a flush of ``flush_bytes`` (``flush_by``: "read" or "write", as in :func:`time_ms`) and
    timed alone by CUDA events around it; as many rounds as fit ``rep_ms`` (10 to 200). Clocks
    or neighbours that drift during the measurement move every fn alike, and no fn always runs
    after the same other. The flush also keeps the GPU busy while the host enqueues the next
    call, so host cost stays out of the times (up to about 0.35 ms per GiB flushed on an H100).
    On CPU: the host clock around each call, rounds taking turns the same way for ``rep_ms``
    (3 to 100 rounds), no flush (smoke runs only).

    Raises:
        ValueError: ``flush_by`` is not "write" or "read", or ``fns`` is empty.
    """
    if flush_by not in ("write", "read"):
        raise ValueError(f"flush_by must be 'write' or 'read', got {flush_by!r}")
    if not fns:
        raise ValueError("fns must hold at least one callable, got none")
    if torch.device(device).type == "cuda":
        return _flushed_turns(fns, device, None, rep_ms, flush_bytes, flush_by)
    samples: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    turns = list(zip(fns, samples, strict=True))
    deadline, rounds = time.perf_counter() + rep_ms / 1000, 0
    while rounds < 3 or (time.perf_counter() < deadline and rounds < 100):
        for fn, times in turns if rounds % 2 == 0 else reversed(turns):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000)
        rounds += 1
    return [quantiles(times) for times in samples]


def _flushed_turns(
    fns: Sequence[Callable[[], object]],
    device: str | torch.device,
    grad_to_none: Iterable[torch.Tensor] | None,
    rep_ms: int,
    flush_bytes: int,
    flush_by: str,
) -> list[tuple[float, float, float]]:
    """CUDA events around each call of each fn, rounds taking turns (order reversed every other
    round), ``flush_bytes`` written or read before every call."""
    flush = torch.zeros(flush_bytes // 4, dtype=torch.int32, device=device)
    total = torch.empty((), dtype=torch.int32, device=device)
    estimate = 0.0
    for fn in fns:
        fn()  # warm-up: compile, tune
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        estimate += start.elapsed_time(end)
    reps = int(min(200, max(10, rep_ms / max(estimate, 1e-3))))
    events = [
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
        for _ in range(reps)
    ]
    for r, pairs in enumerate(events):
        turns = list(zip(fns, pairs, strict=True))
        for fn, (begin, finish) in turns if r % 2 == 0 else reversed(turns):
            _clear_grads(grad_to_none)
            if flush_by == "write":
                flush.zero_()
            else:
                torch.sum(flush, dim=0, out=total)
            begin.record()
            fn()
            finish.record()
    torch.cuda.synchronize()
    return [
        quantiles([pairs[i][0].elapsed_time(pairs[i][1]) for pairs in events])
        for i in range(len(fns))
    ]


def row(
    kernel: str,
    provider: str,
    mode: str,
    x: str,
    dtype: str | torch.dtype,
    times: tuple[float, float, float],
    *,
    work: float | None = None,
    throughput_unit: str = "",
    floor_s: float | None = None,
    baseline: float | None = None,
    unit: str = "ms",
    config: str = "",
    gpu: str = "",
    version: str = "",
    timestamp: str = "",
) -> Row:
    """One results row from a timing ``times`` = (p20, p50, p80) in ``unit``.

    ``work`` (bytes or operations of one call) gives the throughput in 10^12 per second
    (``throughput_unit``: "TB/s", "TFLOP/s", "TOP/s"); ``floor_s`` (the roofline's time for one
    call in seconds, e.g. bytes / copy bandwidth) gives ``roofline_fraction`` = floor / p50;
    ``baseline`` (the baseline provider's p50, same unit) gives ``speedup_vs_baseline``.
    """
    p20, p50, p80 = times
    seconds = p50 * {"ms": 1e-3, "us": 1e-6}[unit]
    return Row(
        kernel=kernel,
        provider=provider,
        mode=mode,
        x=x,
        dtype=str(dtype).removeprefix("torch."),
        p20=p20,
        p50=p50,
        p80=p80,
        unit=unit,
        throughput=work / seconds / 1e12 if work is not None else None,
        throughput_unit=throughput_unit,
        roofline_fraction=floor_s / seconds if floor_s is not None else None,
        speedup_vs_baseline=baseline / p50 if baseline else None,
        config=config,
        gpu=gpu,
        version=version,
        timestamp=timestamp,
    )


def host_us_per_call(fn: Callable[[], object], *, calls: int = 2000, repeats: int = 5) -> float:
    """Median host cost of one call in a host-bound loop (no synchronization inside the loop)."""
    return host_us_side_by_side([fn], calls=calls, repeats=repeats)[0]


def host_us_side_by_side(
    fns: Sequence[Callable[[], object]], *, calls: int = 2000, repeats: int = 5
) -> list[float]:
    """``host_us_per_call`` of each of ``fns``, their loops taking turns: a host that speeds up or
    slows down during the measurement (by 20% and more on a shared machine) moves them alike,
    so their ratios hold."""
    for fn in fns:
        for _ in range(100):
            fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    results: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, results, strict=True):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
            sync()
    return [statistics.median(times) for times in results]


@cache
def copy_bandwidth(device: str = "cuda") -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = 2**30 if torch.device(device).type == "cuda" else 16 * 2**20  # bytes read
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    _, p50, _ = time_ms(lambda: dst.copy_(src), device=device)
    return 2 * n / (p50 * 1e-3)


@cache
def matmul_rate(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured dense matmul rate in FLOP/s on random 8192^3 (CUDA) or 1024^3 (CPU) operands."""
    n = 8192 if torch.device(device).type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    _, p50, _ = time_ms(lambda: a @ b, device=device)
    return 2 * n**3 / (p50 * 1e-3)


def sweep_arguments(description: str, results: Path, quick_help: str) -> argparse.ArgumentParser:
    """The command line every package's sweep shares: --device, --quick, --out, --replot."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--device",
        type=arguments.device,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu)",
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=results, help="folder for the CSV and plot")
    parser.add_argument("--replot", type=Path, help="only redraw the plot of a results CSV")
    return parser


class _PlainProgress:
    """tqdm's interface, as a line per step on stdout, for machines without tqdm."""

    def __init__(self, desc: str = "", total: int | None = None, **_: object) -> None:
        self.desc, self.total, self.n = desc, total, 0

    def __enter__(self) -> _PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{self.desc}: {self.n}/{self.total or '?'}", flush=True)

    def set_postfix_str(self, text: str) -> None:
        print(f"{self.desc}: {self.n}/{self.total or '?'} {text}", flush=True)


def progress_bar(**bar: Any) -> Any:
    """A tqdm bar (``desc``, ``total``, ...) counting cases, or plain lines without tqdm."""
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return _PlainProgress(**bar)
    return tqdm(unit="case", **bar)


def plot_or_say_why_not(
    plot: Callable[[list[Row], Path], Path], rows: list[Row], path: Path
) -> Path | None:
    """``plot(rows, path)``, or None (saying so) where matplotlib is not installed."""
    try:
        return plot(rows, path)
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        print("no plot: matplotlib is not installed (pip install matplotlib)")
        return None


def sweep_main(
    args: argparse.Namespace,
    plot: Callable[[list[Row], Path], Path],
    run: Callable[[Callable[..., object]], list[Row]],
    **bar: Any,
) -> list[Row]:
    """The body of every sweep's ``main()`` after parsing ``sweep_arguments``: ``--replot`` only
    redraws; otherwise ``run(progress)`` under a progress bar (``bar``: tqdm's ``desc``,
    ``total``), then ``<device>.csv`` and its plot under ``--out``, and the rows as a Markdown
    table (the columns are the CSV's, by the CSV's names)."""
    if args.replot:
        print("wrote", replot(args.replot, plot))
        return []
    started = time.perf_counter()
    with progress_bar(**bar) as progress:
        rows = run(progress.update)
    slug = device_slug(args.device)
    csv_path = write_csv(rows, args.out / f"{slug}.csv")
    png = plot_or_say_why_not(plot, rows, args.out / f"{slug}.png")
    print(markdown_table(rows))
    wrote = f"{csv_path} and {png}" if png else str(csv_path)
    print(f"wrote {wrote} in {time.perf_counter() - started:.0f} s")
    return rows


def sweep_command(
    argv: list[str] | None,
    doc: str,
    results: Path,
    run: Callable[..., list[Row]],
    plot: Callable[[list[Row], Path], Path],
    *,
    quick_help: str,
    desc: str,
) -> list[Row]:
    """The whole ``main()`` of a sweep with only the shared command line (``sweep_arguments``,
    described by the first line of the sweep's ``doc``): ``run(device, quick=..., progress=...)``
    makes the rows, ``sweep_main`` does the rest (``desc``: the progress bar's label)."""
    args = sweep_arguments(doc.splitlines()[0], results, quick_help).parse_args(argv)
    return sweep_main(
        args,
        plot,
        lambda progress: run(args.device, quick=args.quick, progress=progress),
        desc=desc,
    )


def load_beside(script: str | Path, name: str) -> ModuleType:
    """The module ``name``.py from the folder of ``script`` (a benchmark's sibling script),
    imported by path and registered in ``sys.modules``: no ``sys.path`` edit, so a sweep loaded
    by the main job finds its siblings as when it runs as a script."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, Path(script).resolve().parent / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None  # a .py path always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def replot(csv_path: Path, plot: Callable[[list[Row], Path], Path]) -> Path:
    """Redraw a sweep's plot from its committed CSV (no GPU needed); returns the PNG path."""
    rows = read_rows(csv_path)
    return plot(rows, Path(csv_path).with_suffix(".png"))


def save_figure(fig: Figure, path: Path, title: str, dpi: int = 110) -> Path:
    """Title, lay out, write and close a matplotlib figure; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_vs_baseline(
    rows: list[Row],
    path: Path,
    *,
    title: str,
    panel: Callable[[Row], tuple[str, str]],
    lower: tuple[str, str] = ("throughput", "TB/s"),
    ratio_targets: dict[str, float] | None = None,
    lower_target: float | None = None,
    dpi: int = 110,
) -> Path:
    """Two rows of panels, one column per ``panel(row)`` (e.g. (dtype, mode)), cases on x.

    Top: time over the baseline provider's (1 / speedup_vs_baseline; log scale; lower is faster),
    with a dashed line at ``ratio_targets[mode]``. Bottom: the row field ``lower[0]`` labelled
    ``lower[1]``, with a dashed line at ``lower_target``. Host-cost rows are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.mode != "host"]
    panels = sorted({panel(r) for r in timed})
    # one color per provider in every panel, whichever providers a panel lacks
    colors = {p: f"C{i % 10}" for i, p in enumerate(dict.fromkeys(r.provider for r in timed))}
    fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7), squeeze=False)
    field, label = lower
    for col, key in enumerate(panels):
        subset = [r for r in timed if panel(r) == key]
        xs = list(dict.fromkeys(r.x for r in subset))
        for provider in dict.fromkeys(r.provider for r in subset):
            by_x = {r.x: r for r in subset if r.provider == provider}
            speedups = [by_x[x].speedup_vs_baseline if x in by_x else None for x in xs]
            ratio = [1 / s if s else None for s in speedups]  # a gap where there is no baseline
            values = [getattr(by_x[x], field) if x in by_x else None for x in xs]
            axes[0][col].plot(xs, ratio, marker="o", label=provider, color=colors[provider])
            axes[1][col].plot(xs, values, marker="o", label=provider, color=colors[provider])
        target = (ratio_targets or {}).get(key[-1])
        if target:
            axes[0][col].axhline(target, color="gray", ls="--", lw=1)
        if lower_target:
            axes[1][col].axhline(lower_target, color="gray", ls="--", lw=1)
        name = " ".join(key)
        axes[0][col].set_title(
            f"{name}: time / baseline" + (" (dashed: target)" if target else ""), fontsize=9
        )
        axes[1][col].set_title(f"{name}: {label}", fontsize=9)
        axes[0][col].set_yscale("log")
        for ax in (axes[0][col], axes[1][col]):
            ax.tick_params(axis="x", rotation=45, labelsize=7)
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8)
    return save_figure(fig, path, title, dpi=dpi)


def torchrun(script: Path, processes: int, arguments: list[str]) -> None:
    """Run a benchmark ``script`` on ``processes`` torchrun ranks of this host (a free port, this
    process's import path as PYTHONPATH, the environment otherwise unchanged, NCCL_* included).

    Raises:
        RuntimeError: the run fails; the message holds the ranks' output.
    """
    import os
    import socket
    import subprocess

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ)  # the ranks import what this process imports (installed or PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-port", str(port), str(script), *arguments,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
