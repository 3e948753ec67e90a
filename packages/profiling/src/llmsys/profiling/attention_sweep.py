"""Causal attention alone: forward and backward time and memory over head dim x sequence length.

The attention benchmark of CS336 assignment 2: batch 8, one head, q, k, v of shape
(batch, 1, seq, d) in the chosen dtype (real tensors, not autocast), requiring grad. By default
d in 16 32 64 128 and seq in 256 1024 4096 8192 16384 with 100 timed passes; on ``--device cpu``
the defaults shrink to d 16, seq 16 32 and 2 passes (Triton runs under its interpreter there).
Implementations (``--impl``): ``naive`` (the eager formula, which stores the (seq, seq) scores;
the baseline of the speedup column), ``compiled`` (``torch.compile`` of it, one graph per shape),
``sdpa`` (``F.scaled_dot_product_attention(is_causal=True)``) and ``flash``
(``llmsys.flash_attn2.flash_attention(causal=True)``, Triton FlashAttention-2).

Method, per case and implementation (fresh random inputs, ``--warmup`` untimed passes before
each timed phase; the first call of ``compiled`` compiles):
- forward: ``--passes`` forwards, each timed alone (the device is synchronized before it; CUDA
  events around it, or the wall clock on CPU). Inputs require grad, so each forward also saves
  what its backward needs, as in training.
- memory (CUDA only): ``torch.cuda.memory_allocated`` after one more forward whose graph is kept,
  i.e. what is in use when a backward starts (q, k, v, the output gradient, saved activations);
  on the forward row.
- backward: ``--passes`` times, an untimed forward, a synchronize, then only
  ``torch.autograd.grad(out, (q, k, v), dout)`` timed (no gradient accumulation into ``.grad``).
Rows give p20 / p50 / p80 of the per-call times, TFLOP/s of the causal FLOPs (forward
2 * 2 * B * N(N+1)/2 * d, backward 2.5x that; the same count for every implementation, so the
naive one's masked-out half is not credited), its fraction of the GPU's dense matmul peak in the
precision the implementation multiplies in (TF32 for fp32 ``flash``; see ``peak_flops``), and the
speedup over ``naive`` in the same case and mode. A case that runs out of memory gets a row
with NaN times and config ``OOM`` (a backward OOM keeps its forward row) and the sweep goes on.
Writes ``attention.png`` (time vs seq, log-log, one panel per d) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int

from .attention import ATTENTION_FUNCTIONS, naive_attention
from .infra import accounting
from .progress import progress
from .training import free_device_memory, is_out_of_memory, synchronize

HELP = "time causal attention (naive, compiled, SDPA, FlashAttention-2) over head dim x seq len"
IMPLS = ("naive", "compiled", "sdpa", "flash")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GPU_DEFAULTS: dict[str, Any] = {
    "head_dim": [16, 32, 64, 128],
    "seq_len": [256, 1024, 4096, 8192, 16384],
}
GPU_DEFAULTS["passes"] = 100
CPU_DEFAULTS: dict[str, Any] = {"head_dim": [16], "seq_len": [16, 32], "passes": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=positive_int, default=8, help="batch")
    parser.add_argument(
        "--head-dim",
        nargs="+",
        type=positive_int,
        help="head dims (default: 16 32 64 128 on cuda, 16 on cpu)",
    )
    parser.add_argument(
        "--seq-len",
        nargs="+",
        type=positive_int,
        help="sequence lengths (default: 256 1024 4096 8192 16384 on cuda, 16 32 on cpu)",
    )
    parser.add_argument(
        "--passes", type=positive_int, help="timed passes per mode (default: 100 on cuda, 2 on cpu)"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed fwd + bwd passes first"
    )
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="q, k, v dtype")
    parser.add_argument(
        "--impl", nargs="+", default=list(IMPLS), choices=IMPLS, help="implementations to compare"
    )


def resolve_defaults(args: argparse.Namespace) -> tuple[list[int], list[int], int]:
    """(head dims, seq lens, passes): the user's values, else the defaults for the device."""
    defaults = CPU_DEFAULTS if torch.device(args.device).type == "cpu" else GPU_DEFAULTS
    return (
        args.head_dim or defaults["head_dim"],
        args.seq_len or defaults["seq_len"],
        args.passes or defaults["passes"],
    )


@functools.cache
def _compiled_naive() -> Callable:
    # Every (shape, dtype) is a new graph (dynamic=False: each compiled for its sizes); raise the
    # recompile limit so that dynamo never silently falls back to eager after 8 shapes.
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name and the older one
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 1024))
    return torch.compile(naive_attention, dynamic=False)


def attention_impl(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The causal attention ``fn(q, k, v) -> out`` of ``name``, all on (B, H, N, d) tensors."""
    if name not in IMPLS:
        raise ValueError(f"attention_impl: `name` must be one of {IMPLS}, got {name!r}")
    return _compiled_naive() if name == "compiled" else ATTENTION_FUNCTIONS[name]


def causal_flops(batch: int, seq: int, d: int, mode: str) -> float:
    """FLOPs of causal attention: 2 matmuls over the N(N+1)/2 visible (query, key) pairs."""
    forward = 2 * 2 * batch * seq * (seq + 1) / 2 * d
    return forward if mode == "forward" else 2.5 * forward


def peak_flops(impl: str, dtype: str, device: torch.device | str) -> tuple[float | None, str]:
    """(dense matmul peak FLOP/s of the precision ``impl`` multiplies in, its description);
    None off CUDA. In fp32, ``flash`` runs its dots in TF32 whatever PyTorch's setting."""
    precision = accounting.matmul_precision(dtype, always_tf32=impl == "flash")
    if torch.device(device).type != "cuda":
        return None, precision
    return accounting.peak_flops(results.device_name(device), precision)


def _time_calls(
    call: Callable[[Any], object],
    passes: int,
    device: torch.device | str,
    prepare: Callable[[], Any] | None = None,
) -> list[float]:
    """Milliseconds of each of ``passes`` runs of ``call(prepare())``; ``prepare`` is untimed.

    The device is synchronized before each call, so the time is the call's alone: CUDA events
    around it (its launches and kernels), or the wall clock on CPU.
    """
    cuda = torch.device(device).type == "cuda"
    times: list[float] = []
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    for _ in range(passes):
        arg = prepare() if prepare else None
        synchronize(device)
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            call(arg)
            end.record()
            events.append((begin, end))
        else:
            start = time.perf_counter()
            call(arg)
            times.append((time.perf_counter() - start) * 1e3)
    synchronize(device)
    return times + [begin.elapsed_time(end) for begin, end in events]


def measure(
    impl: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    passes: int,
    warmup: int,
) -> dict[str, Any]:
    """Forward and backward ms samples and memory before backward (GiB) of one case.

    ``shape`` is (B, 1, N, d). A phase that runs out of memory leaves its entry None (an OOM in
    the forward skips the backward); other errors propagate.
    """
    fn = attention_impl(impl)
    measured: dict[str, Any] = {"forward": None, "backward": None, "memory_gib": None}
    try:
        q, k, v = (
            torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        dout = torch.randn(shape, device=device, dtype=dtype)
        for _ in range(warmup):  # forward only first, so that a backward OOM keeps the forward
            fn(q, k, v)
        measured["forward"] = _time_calls(lambda _: fn(q, k, v), passes, device)
        for _ in range(warmup):
            torch.autograd.grad(fn(q, k, v), (q, k, v), dout)
        out = fn(q, k, v)
        synchronize(device)
        if torch.device(device).type == "cuda":
            measured["memory_gib"] = torch.cuda.memory_allocated(device) / 2**30
        del out
        measured["backward"] = _time_calls(
            lambda out: torch.autograd.grad(out, (q, k, v), dout),
            passes,
            device,
            prepare=lambda: fn(q, k, v),
        )
    except Exception as error:
        if not is_out_of_memory(error):
            raise
    return measured


def case_rows(
    impl: str,
    batch: int,
    seq: int,
    d: int,
    args: argparse.Namespace,
    passes: int,
    measured: dict[str, Any],
) -> list[results.Row]:
    """A forward and a backward row of one (impl, d, seq); NaN times and config OOM if none."""
    gpu, stamp = results.device_name(args.device), results.timestamp()
    peak, precision = peak_flops(impl, args.dtype, args.device)
    rows = []
    for mode in ("forward", "backward"):
        common: dict[str, Any] = dict(
            kernel="attention", provider=impl, mode=mode, x=f"d={d} seq={seq}", dtype=args.dtype,
            gpu=gpu, version=f"torch {torch.__version__}", timestamp=stamp,
        )  # fmt: skip
        times = measured[mode]
        if times is None:
            nan = float("nan")
            rows.append(results.Row(p20=nan, p50=nan, p80=nan, config="OOM", **common))
            continue
        p20, p50, p80 = results.quantiles(times)
        tflops = causal_flops(batch, seq, d, mode) / (p50 * 1e-3) / 1e12
        rows.append(
            results.Row(
                p20=p20, p50=p50, p80=p80,
                throughput=tflops, throughput_unit="TFLOP/s",
                roofline_fraction=tflops * 1e12 / peak if peak else None,
                config=f"batch={batch} heads=1 passes={passes} warmup={args.warmup}; "
                f"roofline: {precision} matmul peak",
                mean=statistics.mean(times),
                std=statistics.stdev(times) if len(times) > 1 else 0.0,
                memory_gib=measured["memory_gib"] if mode == "forward" else None,
                **common,
            )
        )  # fmt: skip
    return rows


def add_speedups(rows: list[results.Row]) -> None:
    """Set ``speedup_vs_baseline`` = naive p50 / p50 of the same case and mode (None without)."""
    naive = {(r.x, r.mode): r.p50 for r in rows if r.provider == "naive" and not math.isnan(r.p50)}
    for r in rows:
        base = naive.get((r.x, r.mode))
        r.speedup_vs_baseline = base / r.p50 if base and not math.isnan(r.p50) else None


def plot(rows: list[results.Row], path: str | Path) -> Path:
    """Forward (solid) and backward (dashed) ms vs seq len per impl, log-log, a panel per d."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg

    def case(row: results.Row) -> tuple[int, int]:  # "d=16 seq=256" -> (16, 256)
        match = re.match(r"d=(\d+) seq=(\d+)", row.x)
        assert match is not None  # (every attention row's x)
        d, seq = match.groups()
        return int(d), int(seq)

    timed = [r for r in rows if r.kernel == "attention" and not math.isnan(r.p50)]
    head_dims = sorted({case(r)[0] for r in timed}) or [0]
    fig = Figure(figsize=(4.5 * len(head_dims), 4), layout="constrained")
    axes = fig.subplots(1, len(head_dims), squeeze=False)[0]
    for ax, d in zip(axes, head_dims, strict=True):
        for i, impl in enumerate(dict.fromkeys(r.provider for r in timed)):
            for mode, style in (("forward", "-"), ("backward", "--")):
                points = sorted(
                    (case(r)[1], r.p50)
                    for r in timed
                    if r.provider == impl and r.mode == mode and case(r)[0] == d
                )
                if points:
                    seqs, times = zip(*points, strict=True)
                    ax.plot(seqs, times, style, marker="o", color=f"C{i}", label=f"{impl} {mode}")
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", title=f"d={d}", xlabel="seq len", ylabel="ms (p50)")
        if ax.lines:  # a panel can be empty when every case ran out of memory
            ax.legend(fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def case_label(case: tuple[int, int, str]) -> str:
    """``naive d=16 seq=32``: a case as the progress line shows it (the CSV's ``x`` after the
    implementation)."""
    d, seq, impl = case
    return f"{impl} d={d} seq={seq}"


def run(args: argparse.Namespace) -> list[results.Row]:
    head_dims, seq_lens, passes = resolve_defaults(args)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    rows = []
    cases = list(itertools.product(head_dims, seq_lens, args.impl))
    for d, seq, impl in progress(cases, "attention", case_label):
        shape = (args.batch_size, 1, seq, d)
        measured = measure(impl, shape, dtype, args.device, passes, args.warmup)  # OOM inside
        free_device_memory(args.device)
        rows += case_rows(impl, args.batch_size, seq, d, args, passes, measured)
    add_speedups(rows)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("attention: matplotlib is not installed; no plot")
    else:
        print(f"wrote {plot(rows, Path(args.out) / 'attention.png')}")
    return rows
