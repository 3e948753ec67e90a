"""The int8 KV cache against the fp16 one: decode attention's error, and on a GPU its time.

    python packages/flash-attn2/benchmarks/decode_int8_kv.py [--device cpu] [--quick] [--out DIR]

(with every package's src/ on PYTHONPATH; on a CPU-only machine with ``TRITON_INTERPRET=1``).
Each case draws a fresh query (one new token per sequence) and an fp16 cache filled to its
capacity, quantizes the cache with ``append_kv_int8`` and runs ``decode_attention`` over both
caches. Keys come in two kinds: Gaussian, and Gaussian with ``OUTLIER_CHANNELS`` channels
``OUTLIER_SCALE`` times larger, as the keys of trained LLMs often have (the reason KIVI and
KVQuant quantize keys per channel): an outlier sets every token's scale, so the other channels
are rounded more coarsely. Values are Gaussian.

Rows (the shared CSV schema of ``llmsys.bench_harness``), per case:

- error rows (no time; the value in ``throughput``): the int8 cache's output against the fp16
  cache's, max abs and relative (``||a - b|| / ||b||``), and each output's relative error
  against the float64 spec of the fp16 cache (the fp16 cache's own error is the floor);
- on a GPU, time rows: ``decode`` over each cache (the KV bytes a call reads, as TB/s and as a
  fraction of the measured copy bandwidth; the int8 row's time over the fp16 row's), and the
  one-token ``append`` into the int8 cache.

GPU cases: Llama-3.1-8B's attention (32 query heads, 8 kv heads, head dim 128), batch 1 and 8,
contexts 1024 to 32768 (``--quick``: batch 1, contexts 1024 and 32768). CPU cases: a tiny
grouped-query shape under the interpreter, errors only (``--quick``: one context). Writes
``DIR/decode_int8_kv_<gpu>.csv`` (default: results/ beside this file).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

import llmsys.bench_harness as harness
from llmsys.bench_harness import results
from llmsys.flash_attn2 import append_kv_int8, decode_attention

decode_common = harness.load_beside(__file__, "decode_common")  # spec, errors, stamp
RESULTS = Path(__file__).parent / "results"
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
GPU_CASES = [(batch, context) for batch in (1, 8) for context in (1024, 4096, 16384, 32768)]
GPU_QUICK = [(1, 1024), (1, 32768)]
CPU_SHAPE = (4, 2, 32)  # heads, kv heads, head dim
CPU_CASES = [(1, 64), (2, 160)]
CPU_QUICK = [(1, 64)]
OUTLIER_CHANNELS = 4
OUTLIER_SCALE = 10.0
KEYS = ("gaussian", "outlier channels")
DTYPE = torch.float16


def make_case(batch, heads, kv_heads, context, head_dim, keys, device):
    """(q, k_cache, v_cache) in fp16: one query per sequence, a cache full to ``context``."""
    q = torch.randn(batch, heads, 1, head_dim, device=device)
    k = torch.randn(batch, kv_heads, context, head_dim, device=device)
    if keys == "outlier channels":
        channels = torch.randperm(head_dim, device=device)[:OUTLIER_CHANNELS]
        k[..., channels] *= OUTLIER_SCALE
    v = torch.randn(batch, kv_heads, context, head_dim, device=device)
    return q.to(DTYPE), k.to(DTYPE), v.to(DTYPE)


def quantized(k_cache, v_cache):
    """(k_int8, v_int8, k_scale, v_scale): the whole cache through ``append_kv_int8``."""
    batch, kv_heads, context, _ = k_cache.shape
    k_int8, v_int8 = (torch.empty(k_cache.shape, dtype=torch.int8, device=k_cache.device)
                      for _ in "kv")  # fmt: skip
    k_scale, v_scale = (torch.empty(batch, kv_heads, context, device=k_cache.device) for _ in "kv")
    starts = torch.zeros(batch, dtype=torch.int32, device=k_cache.device)
    append_kv_int8(k_cache, v_cache, k_int8, v_int8, k_scale, v_scale, starts)
    return k_int8, v_int8, k_scale, v_scale


def measure(batch, heads, kv_heads, context, head_dim, keys, device, stamp, bandwidth):
    """The rows of one case (see the module docstring)."""
    q, k_cache, v_cache = make_case(batch, heads, kv_heads, context, head_dim, keys, device)
    k_int8, v_int8, k_scale, v_scale = quantized(k_cache, v_cache)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)

    def decode_fp16():
        return decode_attention(q, k_cache, v_cache, lengths)

    def decode_int8():
        return decode_attention(q, k_int8, v_int8, lengths, k_scale=k_scale, v_scale=v_scale)

    out_fp16, out_int8 = decode_fp16(), decode_int8()
    want = decode_common.spec(q, k_cache, v_cache)
    x = f"{batch}x{heads}x{kv_heads}x{context}x{head_dim}"
    common = {"kernel": "decode_attention", "x": x, "dtype": "float16", **stamp}
    nan = float("nan")

    def error_row(provider, mode, value):
        return results.Row(
            provider=provider, mode=mode, p20=nan, p50=nan, p80=nan, throughput=value,
            throughput_unit="value", config=f"keys: {keys}", **common,
        )  # fmt: skip

    max_abs = (out_int8.double() - out_fp16.double()).abs().max().item()
    relative_error = decode_common.relative_error
    rows = [
        error_row("int8 cache", "max abs error vs fp16 cache", max_abs),
        error_row("int8 cache", "relative error vs fp16 cache", relative_error(out_int8, out_fp16)),
        error_row("fp16 cache", "relative error vs float64 spec", relative_error(out_fp16, want)),
        error_row("int8 cache", "relative error vs float64 spec", relative_error(out_int8, want)),
    ]
    if torch.device(device).type != "cuda":
        return rows
    tokens = batch * kv_heads * context  # cached (token, kv head) pairs, keys and values each
    fp16_bytes = 2 * tokens * head_dim * 2
    int8_bytes = 2 * tokens * (head_dim + 4)  # int8 values and a float32 scale per row
    fp16_times = harness.time_ms(decode_fp16)
    int8_times = harness.time_ms(decode_int8)
    for provider, times, nbytes, baseline in (
        ("fp16 cache", fp16_times, fp16_bytes, None),
        ("int8 cache", int8_times, int8_bytes, fp16_times[1]),
    ):
        rows.append(harness.row(
            "decode_attention", provider, "decode", x, "float16", times, work=nbytes,
            throughput_unit="TB/s", floor_s=nbytes / bandwidth, baseline=baseline,
            config=f"keys: {keys}; KV bytes read {nbytes / 2**20:.1f} MiB", **stamp,
        ))  # fmt: skip
    k_new, v_new = (torch.randn(batch, kv_heads, 1, head_dim, device=device, dtype=DTYPE)
                    for _ in "kv")  # fmt: skip
    last = lengths - 1  # overwrite the last row: the cache stays full
    times = harness.time_ms(
        lambda: append_kv_int8(k_new, v_new, k_int8, v_int8, k_scale, v_scale, last)
    )
    rows.append(harness.row(
        "append_kv_int8", "int8 cache", "append one token", x, "float16", times,
        config="one new token per sequence", **stamp,
    ))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[results.Row]:
    quick_help = "GPU: batch 1 at contexts 1024 and 32768 only; CPU: one context"
    parser = harness.sweep_arguments(__doc__.splitlines()[0], RESULTS, quick_help)
    args = parser.parse_args(argv)
    device = torch.device(args.device).type
    if device == "cuda":
        heads, kv_heads, head_dim = HEADS, KV_HEADS, HEAD_DIM
        cases = GPU_QUICK if args.quick else GPU_CASES
        bandwidth = harness.copy_bandwidth(args.device)
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)", flush=True)
    else:
        heads, kv_heads, head_dim = CPU_SHAPE
        cases, bandwidth = CPU_QUICK if args.quick else CPU_CASES, None
    stamp = decode_common.stamp(args.device)
    started, rows = time.perf_counter(), []
    with harness.progress_bar(desc="int8 KV cache cases", total=len(cases) * len(KEYS)) as bar:
        for batch, context in cases:
            for keys in KEYS:
                torch.manual_seed(0)
                rows += measure(batch, heads, kv_heads, context, head_dim, keys, args.device,
                                stamp, bandwidth)  # fmt: skip
                bar.update()
                if device == "cuda":
                    torch.cuda.empty_cache()
    name = f"decode_int8_kv_{results.device_slug(args.device)}.csv"
    path = results.write_csv(rows, args.out / name)
    print(results.markdown_table([r for r in rows if math.isnan(r.p50)]))
    timed = [r for r in rows if not math.isnan(r.p50)]
    if timed:
        print(results.markdown_table(timed))
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
