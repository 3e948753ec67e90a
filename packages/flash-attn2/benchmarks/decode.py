"""Decode attention against SDPA's backends and FlashInfer: time, KV bandwidth, error (issue 46).

    python packages/flash-attn2/benchmarks/decode.py [--device cpu] [--quick] [--out DIR]

(with every package's src/ on PYTHONPATH; on a CPU-only machine with ``TRITON_INTERPRET=1``).
Each case draws a query and a KV cache full to its capacity, so every sequence's length is the
capacity and SDPA reads the same cache (sliced to the filled length, which is all of it) with no
padding mask. Providers, side by side in one process:

- ``ours``: ``decode_attention`` (split-KV, native GQA, the cache read in place);
- ``sdpa_flash``, ``sdpa_efficient``, ``sdpa_cudnn``, ``sdpa_math``: SDPA
  (``scaled_dot_product_attention``) with ``enable_gqa=True`` under ``sdpa_kernel`` of that
  backend alone. A backend that refuses
  a case (or runs out of memory) gets a row saying why instead of a time. With ``Q_LEN > 1``
  the new tokens are causal among themselves: SDPA gets the bottom-right causal mask (query
  ``i`` sees keys ``0 .. N - Q_LEN + i``), built once outside the timed region;
- ``flashinfer`` where ``flashinfer-python`` imports: ``BatchDecodeWithPagedKVCacheWrapper``
  (``Q_LEN`` 1: the cache read in place as one page per sequence, layout HND) or
  ``single_prefill_with_kv_cache(causal=True)`` (batch 1, ``Q_LEN > 1``); else a row saying
  "flashinfer not installed".

Rows (the shared CSV schema of ``llmsys.bench_harness``), per case:

- error rows (no time; the value in ``throughput``): each provider's output against the float64
  spec (``decode_common.spec``), relative (``||a - b|| / ||b||``), and ours against
  ``sdpa_math``, max abs;
- on a GPU, time rows, mode ``decode`` (eager) and ``decode, CUDA graph`` (ours and the fused
  SDPA backends each captured in a graph of one call, the replay timed): p20/p50/p80 of one
  call with L2 flushed before it (a 1 GiB read, as a layer meets its cache after the layers
  before it ran), every provider's calls taking turns in alternating order
  (``harness.time_ms_side_by_side``); the K and V bytes read as TB/s and as a fraction of the
  measured copy bandwidth (``roofline_fraction``, as ``decode_int8_kv.py``); and the time over
  the fastest SDPA backend's time of the same case and mode (``speedup_vs_baseline`` is its
  inverse; the table prints time / baseline, lower is faster; ``config`` names that backend);
- on a GPU, host rows: microseconds per call in a loop with no synchronize, ours and the
  fastest SDPA backend of the batch 1, context 1024 case, taking turns over 5 rounds.

GPU cases: the design's roofline quiz (batch 1, 16 new tokens over 8192 cached keys, 64 query
and 64 kv heads, head dim 128, bf16) and Llama-3.1-8B decode (32 query heads, 8 kv heads, head
dim 128, one new token) in bf16 at batch 1, 8, 32, 64 and contexts 1024, 8192, 32768, plus fp16
at batch 8, context 32768 (the largest ``decode_int8_kv.py`` case); cases whose K and V exceed
``MAX_KV_BYTES`` are skipped (none of these do: the largest is 8.6 GB). ``--quick``: the quiz,
batch 1 at 1024, and batch 8 at 32768 in bf16 and fp16. CPU: tiny float32 cases under the
interpreter, errors only (ours and ``sdpa_math``; ``--quick``: one case, GQA with 4 new tokens).
Writes ``DIR/decode_<gpu>.csv`` after each case and, with times, ``DIR/decode_<gpu>.png``
(default DIR: results/ beside this file); prints the tables and a summary per case.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import llmsys.bench_harness as harness
from llmsys.bench_harness import results
from llmsys.flash_attn2 import decode_attention

decode_common = harness.load_beside(__file__, "decode_common")  # spec, errors, stamp
RESULTS = Path(__file__).parent / "results"
MAX_KV_BYTES = 40e9  # a case whose K and V exceed this (half an H100) is skipped
FLUSH_BYTES = 2**30
HOST_ROUNDS = 5
SDPA_BACKENDS = {  # provider -> torch.nn.attention.SDPBackend member
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_math": "MATH",
}
GRAPH_PROVIDERS = ("ours", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")  # no math: its scores
# would take a second copy in the graph's memory pool at the large cases
EAGER, GRAPH = "decode", "decode, CUDA graph"


@dataclasses.dataclass(frozen=True)
class Case:
    """``batch`` sequences of ``q_len`` new tokens over a cache full to ``context`` keys."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    context: int
    head_dim: int
    dtype: torch.dtype

    @property
    def label(self) -> str:
        """The CSV's x: B x H x H_KV x N x D as ``decode_int8_kv.py``'s, then " q<Q_LEN>"."""
        shape = f"{self.batch}x{self.heads}x{self.kv_heads}x{self.context}x{self.head_dim}"
        return shape if self.q_len == 1 else f"{shape} q{self.q_len}"

    @property
    def kv_bytes(self) -> int:
        """The K and V bytes one call reads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.batch * self.kv_heads * self.context * self.head_dim * itemsize


BF16, FP16 = torch.bfloat16, torch.float16
QUIZ = Case(batch=1, heads=64, kv_heads=64, q_len=16, context=8192, head_dim=128, dtype=BF16)


# Llama-3.1-8B's decode attention: 32 query heads, 8 kv heads, head dim 128, one new token.
LLAMA = dict(heads=32, kv_heads=8, q_len=1, head_dim=128)
HOST_CASE = Case(batch=1, context=1024, dtype=BF16, **LLAMA)
GPU_CASES = [
    QUIZ,
    *(
        Case(batch=batch, context=context, dtype=BF16, **LLAMA)
        for batch in (1, 8, 32, 64)
        for context in (1024, 8192, 32768)
    ),
    Case(batch=8, context=32768, dtype=FP16, **LLAMA),
]
GPU_QUICK = [
    QUIZ,
    HOST_CASE,
    *(Case(batch=8, context=32768, dtype=t, **LLAMA) for t in (BF16, FP16)),
]
CPU_QUICK = [
    Case(batch=2, heads=4, kv_heads=2, q_len=4, context=48, head_dim=32, dtype=torch.float32)
]
CPU_CASES = [
    *CPU_QUICK,
    Case(batch=2, heads=4, kv_heads=1, q_len=1, context=300, head_dim=32, dtype=torch.float32),
]


# --- providers -----------------------------------------------------------------------------------


def bottom_right_mask(q_len: int, context: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive ``(Q_LEN, N)`` mask: query ``i`` sees keys ``0 .. N - Q_LEN + i``, -inf after."""
    keys = torch.arange(context, device=device)
    last = torch.arange(context - q_len, context, device=device)[:, None]
    mask = torch.zeros(q_len, context, dtype=dtype, device=device)
    return mask.masked_fill(keys > last, float("-inf"))


def sdpa(q, k_cache, v_cache, length: int) -> Callable[[], torch.Tensor]:
    """SDPA over the cache sliced to ``length`` rows, GQA enabled, under whichever backend the
    caller's ``sdpa_kernel`` allows; the mask (``Q_LEN > 1``) is built here, once."""
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    q_len = q.shape[2]
    mask = None if q_len == 1 else bottom_right_mask(q_len, length, q.dtype, q.device)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def under(backend_name: str, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` under ``sdpa_kernel`` of that one backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def call() -> torch.Tensor:
        with sdpa_kernel(backend):
            return fn()

    return call


def flashinfer_call(case: Case, q, k_cache, v_cache) -> Callable[[], torch.Tensor]:
    """FlashInfer over the same cache in place; returns ``(B, H, Q_LEN, D)`` views.

    Raises:
        ModuleNotFoundError: flashinfer is not installed.
        ValueError: ``Q_LEN > 1`` with more than one sequence (not wired here).
    """
    import flashinfer

    if case.q_len == 1:
        # One page per sequence, page size = capacity: (B, H_KV, N, D) is the HND paged layout.
        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="HND")
        pages = torch.arange(case.batch + 1, dtype=torch.int32, device=q.device)
        last_page_len = torch.full((case.batch,), case.context, dtype=torch.int32, device=q.device)
        wrapper.plan(
            pages, pages[:-1], last_page_len, case.heads, case.kv_heads, case.head_dim,
            case.context, q_data_type=case.dtype, kv_data_type=case.dtype,
        )  # fmt: skip
        q3 = q[:, :, 0].contiguous()  # (B, H, D)
        return lambda: wrapper.run(q3, (k_cache, v_cache)).unsqueeze(2)
    if case.batch != 1:
        raise ValueError(f"flashinfer: Q_LEN {case.q_len} > 1 is wired for batch 1 only")
    q_nhd = q[0].transpose(0, 1).contiguous()  # (Q_LEN, H, D)
    k, v = k_cache[0], v_cache[0]  # (H_KV, N, D)
    return lambda: flashinfer.single_prefill_with_kv_cache(
        q_nhd, k, v, causal=True, kv_layout="HND"
    ).transpose(0, 1)[None]


def refusal(error: BaseException, caught: list[warnings.WarningMessage]) -> str:
    """Why a provider did not run: SDPA's own warnings (each backend it tried says why it
    declined), less their source locations and the backends that ``sdpa_kernel`` turned off;
    else the error's first line."""
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    said = []
    for warning in caught:
        text = re.sub(r"\(Triggered internally at [^)]*\)", "", str(warning.message))
        text = " ".join(text.split())  # one line for the CSV
        if not text.endswith(("not used because:", "has been runtime disabled.")):
            said.append(text)
    return " ".join(said) or f"{type(error).__name__}: {str(error).splitlines()[0]}"


def providers(case: Case, q, k_cache, v_cache, lengths, device: str):
    """(name -> fn, name -> output, name -> why it did not run): every provider, each called
    once (the outputs for the error rows)."""
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "ours": lambda: decode_attention(q, k_cache, v_cache, lengths)
    }
    sdpa_call = sdpa(q, k_cache, v_cache, case.context)
    on_gpu = torch.device(device).type == "cuda"
    for name, backend in SDPA_BACKENDS.items():
        if on_gpu or name == "sdpa_math":  # the others are CUDA kernels
            fns[name] = under(backend, sdpa_call)
    refused: dict[str, str] = {}
    if on_gpu:
        try:
            fns["flashinfer"] = flashinfer_call(case, q, k_cache, v_cache)
        except ModuleNotFoundError as error:
            if error.name != "flashinfer":
                raise
            refused["flashinfer"] = "flashinfer not installed"
        except Exception as error:  # a build or plan failure: say so, time the rest
            refused["flashinfer"] = f"flashinfer failed: {refusal(error, [])}"
    outputs: dict[str, torch.Tensor] = {}
    for name, fn in list(fns.items()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outputs[name] = fn()
            except (RuntimeError, ValueError) as error:  # torch.OutOfMemoryError included
                refused[name] = refusal(error, caught)
                del fns[name]
                if on_gpu:
                    torch.cuda.empty_cache()
    return fns, outputs, refused


# --- one case ------------------------------------------------------------------------------------


def inputs(case: Case, device: str):
    """(q, k_cache, v_cache, cache_seqlens): Gaussian, in the case's dtype, every sequence full."""
    q = torch.randn(
        case.batch, case.heads, case.q_len, case.head_dim, device=device, dtype=case.dtype
    )
    shape = (case.batch, case.kv_heads, case.context, case.head_dim)
    k_cache, v_cache = (torch.randn(shape, device=device, dtype=case.dtype) for _ in "kv")
    lengths = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, lengths


def measure(case: Case, device: str, stamp: dict[str, str], bandwidth: float | None):
    """The rows of one case (see the module docstring) and its fastest SDPA backend's name."""
    q, k_cache, v_cache, lengths = inputs(case, device)
    fns, outputs, refused = providers(case, q, k_cache, v_cache, lengths, device)
    dtype = str(case.dtype).removeprefix("torch.")
    common = {"kernel": "decode_attention", "x": case.label, "dtype": dtype, **stamp}
    nan = float("nan")

    def untimed(provider, mode, value=None, config=""):
        return results.Row(
            provider=provider, mode=mode, p20=nan, p50=nan, p80=nan, throughput=value,
            throughput_unit="value" if value is not None else "", config=config, **common,
        )  # fmt: skip

    want = decode_common.spec(q, k_cache, v_cache)
    rows = [
        untimed(name, "relative error vs float64 spec", decode_common.relative_error(out, want))
        for name, out in outputs.items()
    ]
    if "ours" in outputs and "sdpa_math" in outputs:
        diff = (outputs["ours"].double() - outputs["sdpa_math"].double()).abs().max().item()
        rows.append(untimed("ours", "max abs difference vs sdpa_math", diff))
    del outputs, want
    if torch.device(device).type != "cuda":
        return rows, None
    rows += [untimed(name, EAGER, config=f"not run: {why}") for name, why in refused.items()]
    timed = {(name, EAGER): fn for name, fn in fns.items()}
    for name in GRAPH_PROVIDERS:
        if name in fns:
            try:
                timed[name, GRAPH] = harness.cuda_graph(fns[name])
            except RuntimeError as error:
                rows.append(untimed(name, GRAPH, config=f"not captured: {refusal(error, [])}"))
                torch.cuda.empty_cache()
    spreads = harness.time_ms_side_by_side(list(timed.values()), flush_bytes=FLUSH_BYTES)
    times = dict(zip(timed, spreads, strict=True))
    fastest = {}  # mode -> the fastest SDPA backend's name
    for mode in (EAGER, GRAPH):
        sdpa_times = {n: t[1] for (n, m), t in times.items() if m == mode and n.startswith("sdpa")}
        if sdpa_times:
            fastest[mode] = min(sdpa_times, key=sdpa_times.__getitem__)
    for (name, mode), spread in times.items():
        baseline = fastest.get(mode)
        rows.append(harness.row(
            "decode_attention", name, mode, case.label, dtype, spread, work=case.kv_bytes,
            throughput_unit="TB/s", floor_s=case.kv_bytes / bandwidth,
            baseline=times[baseline, mode][1] if baseline else None,
            config=f"baseline: {baseline or 'none (no SDPA backend ran)'} (the fastest SDPA); "
            f"KV bytes read {case.kv_bytes / 2**20:.1f} MiB",
            **stamp,
        ))  # fmt: skip
    return rows, fastest.get(EAGER)


def host_rows(case: Case, sdpa_backend: str, stamp: dict[str, str]) -> list[results.Row]:
    """Host microseconds per call of ours and of SDPA under ``sdpa_backend`` (the case's fastest),
    in loops with no synchronize, taking turns over ``HOST_ROUNDS`` rounds."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k_cache, v_cache, lengths = inputs(case, "cuda")
    fns = {
        "ours": lambda: decode_attention(q, k_cache, v_cache, lengths),
        sdpa_backend: sdpa(q, k_cache, v_cache, case.context),  # the backend set around the loop
    }
    samples: dict[str, list[float]] = {name: [] for name in fns}
    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[sdpa_backend])):
        for _ in range(HOST_ROUNDS):
            costs = harness.host_us_side_by_side(list(fns.values()), calls=500, repeats=1)
            for name, us in zip(fns, costs, strict=True):
                samples[name].append(us)
    baseline = statistics.median(samples[sdpa_backend])
    config = (
        f"baseline: {sdpa_backend}; loops of 500 calls with no synchronize, "
        f"{HOST_ROUNDS} rounds taking turns"
    )
    rows = []
    for name, values in samples.items():
        rows.append(harness.row(
            "decode_attention", name, "host", case.label, str(case.dtype).removeprefix("torch."),
            results.quantiles(values), unit="us", baseline=baseline, config=config, **stamp,
        ))  # fmt: skip
    return rows


# --- report --------------------------------------------------------------------------------------


def summary(rows: list[results.Row]) -> str:
    """One line per case: ours, the fastest SDPA backend, FlashInfer, eager and graph."""
    head = (
        "| case | dtype | ours | fastest SDPA | ours / fastest SDPA (time ratio, lower is faster) "
        "| ours of copy bandwidth | flashinfer | ours, CUDA graph | ours / fastest SDPA, CUDA "
        "graph (lower is faster) |"
    )
    lines = [head, "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    by = {(r.x, r.dtype, r.mode, r.provider): r for r in rows if r.mode in (EAGER, GRAPH)}
    for x, dtype in dict.fromkeys((r.x, r.dtype) for r in rows if r.mode == EAGER):
        ours, graph = by.get((x, dtype, EAGER, "ours")), by.get((x, dtype, GRAPH, "ours"))
        if ours is None or math.isnan(ours.p50):
            continue
        sdpa_rows = [
            r for (rx, rd, mode, name), r in by.items()
            if (rx, rd, mode) == (x, dtype, EAGER) and name.startswith("sdpa") and r.p50 == r.p50
        ]  # fmt: skip
        fastest = min(sdpa_rows, key=lambda r: r.p50, default=None)
        fi = by.get((x, dtype, EAGER, "flashinfer"))
        cells = [
            x, dtype, f"{ours.p50:.4g} ms",
            f"{fastest.provider} {fastest.p50:.4g} ms" if fastest else "none ran",
            _ratio(ours), f"{ours.roofline_fraction:.0%}",
            (f"{fi.p50:.4g} ms" if fi.p50 == fi.p50 else fi.config) if fi else "",
            f"{graph.p50:.4g} ms" if graph and graph.p50 == graph.p50 else "",
            _ratio(graph) if graph else "",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(row: results.Row) -> str:
    return f"{1 / row.speedup_vs_baseline:.2f}x" if row.speedup_vs_baseline else ""


def plot(rows: list[results.Row], path: Path) -> Path:
    """Per (dtype, mode): time over the fastest SDPA backend's (dashed: issue 46's 1.3x faster)
    and the fraction of copy bandwidth (dashed: its 80%). ``sdpa_math``, tens of times slower,
    is left out (it is in the CSV)."""
    timed = [
        r for r in rows
        if r.mode in (EAGER, GRAPH) and r.p50 == r.p50 and r.provider != "sdpa_math"  # not NaN
    ]  # fmt: skip
    return harness.plot_vs_baseline(
        timed, path, title=f"decode attention on {timed[0].gpu}",
        panel=lambda r: (r.dtype, r.mode), lower=("roofline_fraction", "of copy bandwidth"),
        ratio_targets={EAGER: 1 / 1.3, GRAPH: 1 / 1.3}, lower_target=0.8,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[results.Row]:
    quick_help = "GPU: the quiz, batch 1 at 1024, batch 8 at 32768 (bf16, fp16); CPU: one case"
    parser = harness.sweep_arguments(__doc__.splitlines()[0], RESULTS, quick_help)
    args = parser.parse_args(argv)
    if args.replot:
        print("wrote", harness.replot(args.replot, plot))
        return []
    device = torch.device(args.device).type
    if device == "cuda":
        cases = GPU_QUICK if args.quick else GPU_CASES
        skipped = [c.label for c in cases if c.kv_bytes > MAX_KV_BYTES]
        cases = [c for c in cases if c.kv_bytes <= MAX_KV_BYTES]
        if skipped:
            print(f"skipped (K and V over {MAX_KV_BYTES / 1e9:.0f} GB): {', '.join(skipped)}")
        bandwidth = harness.copy_bandwidth(args.device)
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)", flush=True)
    else:
        cases, bandwidth = CPU_QUICK if args.quick else CPU_CASES, None
    stamp = decode_common.stamp(args.device)
    csv_path = args.out / f"decode_{results.device_slug(args.device)}.csv"
    started, rows, host_backend = time.perf_counter(), [], None
    with harness.progress_bar(desc="decode cases", total=len(cases)) as bar:
        for case in cases:
            torch.manual_seed(0)
            case_rows, fastest = measure(case, args.device, stamp, bandwidth)
            rows += case_rows
            host_backend = fastest if case == HOST_CASE else host_backend
            results.write_csv(rows, csv_path)  # a cut-short run keeps its rows
            bar.update()
            if device == "cuda":
                torch.cuda.empty_cache()
    if host_backend:
        rows += host_rows(HOST_CASE, host_backend, stamp)
        results.write_csv(rows, csv_path)
    print(results.markdown_table([r for r in rows if r.throughput_unit == "value"]))
    timed = [r for r in rows if r.throughput_unit != "value"]
    if timed:
        print(results.markdown_table(timed))
        print(summary(rows))
        png = harness.plot_or_say_why_not(plot, rows, csv_path.with_suffix(".png"))
        print(f"wrote {png}" if png else "no plot")
    print(f"wrote {csv_path} in {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
