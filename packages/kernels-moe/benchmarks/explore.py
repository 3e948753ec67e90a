"""GPU exploration behind benchmarks/NOTES.md: launch configurations, the routing pass alone,
host cost, the small case with and without the host sync, and torch.compile's compile time.

    python benchmarks/explore.py [--quick]

Prints tables; nothing is written. Each number is a do_bench median (L2 flushed) in microseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

import llmsys.kernels_moe as km
from llmsys.kernels_moe import ops
from llmsys_bench import harness

CASES = [(512, 2048, 2, 8), (4096, 4096, 8, 128), (4096, 7168, 8, 256), (16384, 4096, 8, 128)]
CASES += [(16384, 7168, 8, 256)]
ZERO_CONFIGS = [(16, 1024), (32, 512), (64, 256)]
DEFAULT_ROUTE = (ops.TARGET_BLOCKS, ops.LAYOUT_TILE, ops.COUNT_WARPS)
# (TARGET_BLOCKS, LAYOUT_TILE, COUNT_WARPS) of the two-pass route
ROUTE_CONFIGS = [(256, 32, 4), (512, 16, 4), (1024, 16, 4)]


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def routing(num_tokens, topk, num_experts):
    top = torch.rand(num_tokens, num_experts, device="cuda").topk(topk, dim=1).indices
    return top, torch.bincount(top.reshape(-1), minlength=num_experts)


def with_config(name, value, fn):
    saved = getattr(ops, name)
    setattr(ops, name, value)
    try:
        return fn()
    finally:
        setattr(ops, name, saved)


def explore_case(case, copy_bw):
    num_tokens, hidden, topk, num_experts = case
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    top, counts = routing(num_tokens, topk, num_experts)
    bound = num_tokens * topk + num_experts * 127
    exact = int(((counts + 127) // 128 * 128).sum())
    pairs = num_tokens * topk
    print(f"\n## T={num_tokens} H={hidden} k={topk} E={num_experts}: rows {exact}, bound {bound}")
    # floors (bytes really moved / copy bandwidth), in us
    permute_floor = (num_tokens + exact) * hidden * 2 / copy_bw * 1e6
    unpermute_floor = (pairs + num_tokens) * hidden * 2 / copy_bw * 1e6
    print(f"floor: permute {permute_floor:.1f} us (exact rows), unpermute {unpermute_floor:.1f} us")

    padded = torch.empty_like(counts)
    print("| TARGET_BLOCKS/LAYOUT_TILE/COUNT_WARPS | route us | config |")
    for target, tile, warps in ROUTE_CONFIGS:
        ops.TARGET_BLOCKS, ops.LAYOUT_TILE, ops.COUNT_WARPS = target, tile, warps
        ops.route_config.cache_clear()
        cfg = ops.route_config(pairs, num_experts)
        route = us(lambda cfg=cfg: ops._route(top, counts, num_experts, 128, padded, cfg))
        print(f"| {target}/{tile}/{warps} | {route:.1f} | {cfg} |")
    ops.TARGET_BLOCKS, ops.LAYOUT_TILE, ops.COUNT_WARPS = DEFAULT_ROUTE
    ops.route_config.cache_clear()
    if pairs <= 4096:
        multi = ops.RouteConfig(64, 8, 128, -(-pairs // 128), 8)
        route = us(lambda: ops._route(top, counts, num_experts, 128, padded, multi))
        print(f"small case forced through the two-pass route: {route:.1f} us")

    def permute(**kw):
        return km.padded_moe_permute(x, top, counts, topk, num_experts, **kw)

    grouped, _, row_index = km.padded_moe_permute(
        x, top, counts, topk, num_experts, return_row_index=True
    )
    weights = torch.rand(num_tokens, topk, device="cuda")
    print("| ZERO_ROWS/ZERO_H | permute out_rows |")
    for zero_rows, zero_h in ZERO_CONFIGS:
        t = with_config(
            "zero_config",
            lambda h, s, zr=zero_rows, zh=zero_h: (zr, zh),
            lambda: us(lambda: permute(out_rows=bound)),
        )
        print(f"| {zero_rows}/{zero_h} | {t:.1f} |")
    eager_permute = us(lambda: km.padded_moe_permute_reference(x, top, counts, topk, num_experts))
    eager_unpermute = us(lambda: km.moe_unpermute_reference(grouped, row_index, weights))
    ours_permute, ours_unpermute = (
        us(lambda: permute()),
        us(lambda: km.moe_unpermute(grouped, row_index, weights)),
    )
    ours_out_rows = us(lambda: permute(out_rows=bound))
    print(
        f"eager permute {eager_permute:.1f} us (ours {ours_permute:.1f}, "
        f"{eager_permute / ours_permute:.1f}x; out_rows {ours_out_rows:.1f}); eager unpermute "
        f"{eager_unpermute:.1f} us (ours {ours_unpermute:.1f}, "
        f"{eager_unpermute / ours_unpermute:.1f}x)"
    )
    # backward of the unpermute (mark + scatter + weights' gradient)
    grad_y = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    bwd = us(
        lambda: torch.ops.llmsys.moe_unpermute_backward(grad_y, grouped, row_index, weights, True)
    )
    bwd_floor = (num_tokens + exact + pairs) * hidden * 2 / copy_bw * 1e6
    print(f"unpermute backward: {bwd:.1f} us (floor {bwd_floor:.1f})")


def pinned_read_back(status: torch.Tensor) -> list[int]:
    """The alternative to status.tolist() that was measured (and lost): a pinned buffer."""
    host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
    host.copy_(status, non_blocking=True)
    torch.cuda.current_stream(status.device).synchronize()
    return host.tolist()


def small_case_details():
    num_tokens, hidden, topk, num_experts = 512, 2048, 2, 8
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    top, counts = routing(num_tokens, topk, num_experts)
    bound = num_tokens * topk + num_experts * 127
    grouped, _, row_index = km.padded_moe_permute(
        x, top, counts, topk, num_experts, return_row_index=True
    )
    weights = torch.rand(num_tokens, topk, device="cuda")
    print("\n## small case: host cost per call (us, host-bound loop)")
    calls = {
        "permute exact (1 sync)": lambda: km.padded_moe_permute(x, top, counts, topk, num_experts),
        "permute out_rows": lambda: km.padded_moe_permute(
            x, top, counts, topk, num_experts, out_rows=bound
        ),
        "unpermute": lambda: km.moe_unpermute(grouped, row_index, weights),
        "eager permute": lambda: km.padded_moe_permute_reference(x, top, counts, topk, num_experts),
        "eager unpermute": lambda: km.moe_unpermute_reference(grouped, row_index, weights),
        "check_permute_inputs": lambda: ops.check_permute_inputs(
            x, top, counts, num_experts, 128, bound
        ),
        "torch.empty x2": lambda: (torch.empty(10, device="cuda"), torch.empty(5, device="cuda")),
    }
    status = torch.zeros(6, dtype=torch.int32, device="cuda")
    calls["status.tolist() (sync)"] = status.tolist
    calls["pinned read-back (sync)"] = lambda: pinned_read_back(status)
    for name, fn in calls.items():
        print(f"{name:24} {harness.host_us_per_call(fn, calls=300):7.1f}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        km.padded_moe_permute(x, top, counts, topk, num_experts, out_rows=bound)
    print(f"permute out_rows in a CUDA graph: {us(graph.replay):.1f} us")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        km.moe_unpermute(grouped, row_index, weights)
    print(f"unpermute in a CUDA graph: {us(graph.replay):.1f} us")


def compile_times():
    print("\n## torch.compile of the eager references (first call = compile)")
    for case in [(512, 2048, 2, 8), (4096, 4096, 8, 128)]:
        num_tokens, hidden, topk, num_experts = case
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
        top, counts = routing(num_tokens, topk, num_experts)
        bound = num_tokens * topk + num_experts * 127
        permute = torch.compile(km.padded_moe_permute_reference, dynamic=False)
        started = time.perf_counter()
        permute(x, top, counts, topk, num_experts, out_rows=bound, return_row_index=True)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - started
        t = us(lambda: permute(x, top, counts, topk, num_experts, out_rows=bound))
        grouped, _, row_index = km.padded_moe_permute(
            x, top, counts, topk, num_experts, return_row_index=True
        )
        weights = torch.rand(num_tokens, topk, device="cuda")
        unpermute = torch.compile(km.moe_unpermute_reference, dynamic=False)
        started = time.perf_counter()
        unpermute(grouped, row_index, weights)
        torch.cuda.synchronize()
        compile_u = time.perf_counter() - started
        tu = us(lambda: unpermute(grouped, row_index, weights))
        print(
            f"{case}: permute compile {compile_s:.1f} s, {t:.1f} us; "
            f"unpermute compile {compile_u:.1f} s, {tu:.1f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    args = parser.parse_args()
    copy_bw = harness.copy_bandwidth("cuda")
    print(f"{harness.device_name()}: copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write)")
    small_case_details()
    for case in CASES[:2] if args.quick else CASES:
        explore_case(case, copy_bw)
    if not args.skip_compile:
        compile_times()


if __name__ == "__main__":
    main()
