"""Issue 30's cases: FlashAttention at head dims 64 and 128 against SDPA's cuDNN and flash backends.

    python benchmarks/hopper.py [--out DIR]

Needs a CUDA GPU. bf16, side by side in one process: forward+backward causal and not at
4x32x2048x128 and 4x32x8192x128, with grouped-query heads (32 q / 8 kv, SDPA's
``enable_gqa=True``), the leaderboard case 1x16x16384x64, and the forward alone at B=4, H=32
from 2k to 16k tokens at head dims 64 and 128. Providers: ``ours``, ``previous`` (ours with the
pointer forward of 0.1), ``sdpa_cudnn``, ``sdpa_flash``. Writes ``<gpu>-hopper.csv`` (the shared
schema; TFLOP/s counting 4 * B * H * N^2 * d per forward, halved when causal, backward 2.5x) and
its plot under DIR (default: results/ beside this file).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from sweep import previous
from torch.nn.attention import SDPBackend, sdpa_kernel

import llmsys.bench_harness as harness
import llmsys.flash_attn2 as fa

RESULTS = Path(__file__).parent / "results"
FACTOR = {"fwd": 1.0, "fwd_bwd": 3.5}


def cases() -> list[tuple]:
    """(shape, kv_heads, causal, modes)."""
    found = [((1, 16, 16384, 64), 16, True, ("fwd", "fwd_bwd"))]
    for n in (2048, 8192):
        for causal in (True, False):
            found.append(((4, 32, n, 128), 32, causal, ("fwd", "fwd_bwd")))
            found.append(((4, 32, n, 128), 8, causal, ("fwd", "fwd_bwd")))
    for d in (64, 128):
        for n in (2048, 4096, 8192, 16384):
            if (d, n) not in ((128, 2048), (128, 8192)):
                found.append(((4, 32, n, d), 32, True, ("fwd",)))
    return found


def providers() -> dict:
    def sdpa(backend):
        def attention(q, k, v, causal):
            with sdpa_kernel(backend):
                gqa = k.shape[1] != q.shape[1]
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        return attention

    return {
        "ours": lambda q, k, v, causal: fa.flash_attention(q, k, v, causal=causal),
        "previous": previous,
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    }


def time_case(fn, shape, kv_heads, causal, mode) -> tuple | str:
    b, _, n, d = shape
    try:
        q = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, kv_heads, n, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        if mode == "fwd":
            with torch.no_grad():
                return harness.time_ms(lambda: fn(q, k, v, causal))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        grad_out = torch.randn_like(q)
        return harness.time_ms(lambda: fn(*leaves, causal).backward(grad_out), grad_to_none=leaves)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        return "unsupported: " + str(error).splitlines()[0][:80]
    finally:
        torch.cuda.empty_cache()


def run() -> list[harness.Row]:
    gpu, stamp = harness.device_name("cuda"), harness.timestamp()
    rows = []
    bar = harness.progress_bar(desc="flash hopper", total=len(cases()))
    for shape, kv_heads, causal, modes in cases():
        bar.update(1)
        b, h, n, d = shape
        case = f"{'x'.join(map(str, shape))} kv{kv_heads} {'causal' if causal else 'full'}"
        for mode in modes:
            flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0) * FACTOR[mode]
            timings = {
                name: time_case(fn, shape, kv_heads, causal, mode)
                for name, fn in providers().items()
            }
            base = timings["sdpa_cudnn"]
            for name, result in timings.items():
                timed = isinstance(result, tuple)
                rows.append(
                    harness.row(
                        "flash_attention",
                        name,
                        mode,
                        case,
                        torch.bfloat16,
                        result if timed else (float("nan"),) * 3,
                        work=flops if timed else None,
                        throughput_unit="TFLOP/s",
                        baseline=base[1] if timed and isinstance(base, tuple) else None,
                        config="" if timed else result,
                        gpu=gpu,
                        version=fa.__version__,
                        timestamp=stamp,
                    )
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = run()
    path = harness.write_csv(rows, args.out / f"{harness.device_slug('cuda')}-hopper.csv")
    print(harness.markdown_table(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
