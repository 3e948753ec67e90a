"""MoE permute/unpermute sweep: the issue's cases x {eager, torch.compile, ours}; fwd, bwd, host.

Writes ``results/<gpu>.csv`` (the shared schema of ``llmsys.bench_harness``) and
``results/<gpu>.png``. Run ``python benchmarks/sweep.py --help``; the ``bench`` main job calls
:func:`run`.

Bytes are counted as the issue counts them: the permute reads ``num_tokens * topk * hidden``
elements and writes ``out_rows * hidden``; the unpermute reads ``num_tokens * topk * hidden`` and
writes ``num_tokens * hidden``. Our permute reads each token row once (``num_tokens * hidden``),
so its fraction of the copy bandwidth by that count can exceed 1; ``config`` gives the fraction
for the bytes it really moves (``min_bytes_frac``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import llmsys.bench_harness as harness
import llmsys.kernels_moe as km

RESULTS = Path(__file__).parent / "results"
ALIGN = 128
# (num_tokens, hidden, topk, num_experts): the small case, then its 2 x 2 x 2 grid.
GPU_CASES = [(512, 2048, 2, 8)] + [
    (t, h, 8, e) for t in (4096, 16384) for h in (4096, 7168) for e in (128, 256)
]
CPU_CASES = [(16, 32, 2, 4)]
HOST_CASE = (512, 2048, 2, 8)


def case_name(case) -> str:
    return "T{}-H{}-k{}-E{}".format(*case)


def routing(num_tokens, topk, num_experts, device):
    """Distinct uniformly random experts per token, and their counts."""
    scores = torch.rand(num_tokens, num_experts, device=device)
    top = scores.topk(topk, dim=1).indices  # (T, k) int64
    counts = torch.bincount(top.reshape(-1), minlength=num_experts)
    return top, counts


def out_rows_bound(num_tokens, topk, num_experts) -> int:
    return num_tokens * topk + num_experts * (ALIGN - 1)


def permute_providers(device: str, compile_eager: bool) -> dict:
    """name -> fn(x, top, counts, topk, num_experts) returning (rows, row_index)."""

    def eager(x, top, counts, topk, e):
        out, _, rows = km.padded_moe_permute_reference(
            x, top, counts, topk, e, align=ALIGN, return_row_index=True
        )
        return out, rows

    def ours(x, top, counts, topk, e):
        out, _, rows = km.padded_moe_permute(x, top, counts, topk, e, return_row_index=True)
        return out, rows

    def ours_out_rows(x, top, counts, topk, e):
        bound = out_rows_bound(x.shape[0], topk, e)
        out, _, rows = km.padded_moe_permute(
            x, top, counts, topk, e, out_rows=bound, return_row_index=True
        )
        return out, rows

    found = {"eager": eager, "ours": ours, "ours-out_rows": ours_out_rows}
    if compile_eager:
        # One specialization per case (dynamic=False): the default limit of 8 would send the
        # last cases back to eager.
        torch._dynamo.config.cache_size_limit = 64
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = 64
        # The reference with a fixed out_rows: without it the row count is data (a graph break).
        reference = functools.partial(km.padded_moe_permute_reference, align=ALIGN)
        compiled = torch.compile(reference, dynamic=False)

        def eager_compiled(x, top, counts, topk, e):
            out, _, rows = compiled(
                x, top, counts, topk, e, out_rows=out_rows_bound(x.shape[0], topk, e),
                return_row_index=True,
            )  # fmt: skip
            return out, rows

        found["torch.compile"] = eager_compiled
    return found


def unpermute_providers(device: str, compile_eager: bool) -> dict:
    found = {"eager": km.moe_unpermute_reference, "ours": km.moe_unpermute}
    if compile_eager:
        found["torch.compile"] = torch.compile(km.moe_unpermute_reference, dynamic=False)
    return found


def skipped(device: str) -> list[str]:
    """What this sweep leaves out on ``device``, and why."""
    if device != "cuda":
        return [
            "torch.compile and host-cost rows, bfloat16 and the large sizes (up to "
            "T16384-H4096-k8-E128) need a CUDA GPU (on CPU the Triton kernels run under the "
            "slow interpreter)"
        ]
    return []


def _row(kind, provider, mode, case, dtype, times, nbytes, copy_bw, baseline, config, stamp, gpu):
    return harness.row(
        kind, provider, mode, case_name(case), dtype, times, work=nbytes, throughput_unit="TB/s",
        floor_s=nbytes / copy_bw, baseline=baseline, config=config, gpu=gpu,
        version=km.__version__, timestamp=stamp,
    )  # fmt: skip


def run(device: str = "cuda", *, quick: bool = False, progress=None, compile_eager=None):
    """Time every provider on every case; returns the rows (speed-up is eager time / time)."""
    cases = GPU_CASES if device == "cuda" else CPU_CASES
    if quick:
        cases = cases[:2]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    compile_eager = device == "cuda" if compile_eager is None else compile_eager
    permutes = permute_providers(device, compile_eager)
    unpermutes = unpermute_providers(device, compile_eager)
    stamp, copy_bw, size = harness.timestamp(), harness.copy_bandwidth(device), dtype.itemsize
    gpu = harness.device_name(device)
    rows: list[harness.Row] = []
    for case in cases:
        num_tokens, hidden, topk, num_experts = case
        pairs = num_tokens * topk
        x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
        top, counts = routing(num_tokens, topk, num_experts, device)
        exact = int(((counts + ALIGN - 1) // ALIGN * ALIGN).sum())
        for mode in ("fwd", "fwd_bwd"):
            x.requires_grad_(mode == "fwd_bwd")
            baseline = None
            for name, fn in permutes.items():
                if mode == "fwd_bwd" and name == "torch.compile":
                    continue
                out_rows = out_rows_bound(num_tokens, topk, num_experts) if "out" in name else exact
                if name == "torch.compile":
                    out_rows = out_rows_bound(num_tokens, topk, num_experts)
                grad = torch.randn(out_rows, hidden, device=device, dtype=dtype)

                def step(fn=fn, mode=mode, grad=grad):
                    out, _ = fn(x, top, counts, topk, num_experts)
                    if mode == "fwd_bwd":
                        out.backward(grad)

                times = harness.time_ms(step, device=device, grad_to_none=[x])
                nbytes = (pairs + out_rows) * hidden * size
                real = (num_tokens + out_rows) * hidden * size
                if mode == "fwd_bwd":  # + the backward: gather topk rows, write one per token
                    nbytes += (pairs + num_tokens) * hidden * size
                    real += (pairs + num_tokens) * hidden * size
                baseline = times[1] if name == "eager" else baseline
                frac = real / (times[1] * 1e-3) / copy_bw
                config = f"out_rows={out_rows} min_bytes_frac={frac:.2f}"
                rows.append(
                    _row("moe_permute", name, mode, case, dtype, times, nbytes, copy_bw,
                         baseline, config, stamp, gpu)
                )  # fmt: skip
            x.requires_grad_(False)
            grouped, _, row_index = km.padded_moe_permute(
                x, top, counts, topk, num_experts, return_row_index=True
            )
            expert_out = torch.randn_like(grouped).requires_grad_(mode == "fwd_bwd")
            weights = torch.rand(num_tokens, topk, device=device, dtype=torch.float32)
            weights.requires_grad_(mode == "fwd_bwd")
            grad_y = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
            baseline = None
            for name, fn in unpermutes.items():
                if mode == "fwd_bwd" and name == "torch.compile":
                    continue

                def step(fn=fn, mode=mode):
                    y = fn(expert_out, row_index, weights)
                    if mode == "fwd_bwd":
                        y.backward(grad_y)

                times = harness.time_ms(step, device=device, grad_to_none=[expert_out, weights])
                nbytes = (pairs + num_tokens) * hidden * size
                if mode == "fwd_bwd":  # read g, write every row of grad_src, read rows for dw
                    nbytes += (num_tokens + grouped.shape[0] + pairs) * hidden * size
                baseline = times[1] if name == "eager" else baseline
                rows.append(
                    _row("moe_unpermute", name, mode, case, dtype, times, nbytes, copy_bw,
                         baseline, f"rows={grouped.shape[0]}", stamp, gpu)
                )  # fmt: skip
        if progress:
            progress()
    if device == "cuda":
        rows += host_rows(permutes, unpermutes, stamp)
    return rows


def host_rows(permutes: dict, unpermutes: dict, stamp: str) -> list[harness.Row]:
    """Host cost of one call of the small case in a host-bound loop (microseconds)."""
    num_tokens, hidden, topk, num_experts = HOST_CASE
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    top, counts = routing(num_tokens, topk, num_experts, "cuda")
    grouped, _, row_index = km.padded_moe_permute(
        x, top, counts, topk, num_experts, return_row_index=True
    )
    weights = torch.rand(num_tokens, topk, device="cuda")
    calls = {
        ("moe_permute", name): functools.partial(fn, x, top, counts, topk, num_experts)
        for name, fn in permutes.items()
    }
    calls |= {
        ("moe_unpermute", name): functools.partial(fn, grouped, row_index, weights)
        for name, fn in unpermutes.items()
    }
    costs = {key: harness.host_us_per_call(fn, calls=300) for key, fn in calls.items()}
    return [
        harness.row(
            kind,
            name,
            "host",
            case_name(HOST_CASE),
            "bfloat16",
            (us, us, us),
            unit="us",
            baseline=costs[(kind, "eager")],
            gpu=harness.device_name("cuda"),
            version=km.__version__,
            timestamp=stamp,
        )
        for (kind, name), us in costs.items()
    ]


def plot(rows: list[harness.Row], path: Path) -> Path:
    """Per op and mode: time relative to eager (lower is better) and the issue's bandwidth."""
    return harness.plot_vs_baseline(
        rows,
        path,
        title=f"MoE permute / unpermute on {rows[0].gpu}" if rows else "MoE permute",
        panel=lambda r: (r.kernel, r.mode),
        lower=("roofline_fraction", "issue bytes / copy bandwidth"),
        lower_target=0.8,
        dpi=100,
    )


def main(argv: list[str] | None = None) -> None:
    parser = harness.sweep_arguments(
        __doc__.splitlines()[0], RESULTS, quick_help="only the two smallest cases"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = parser.parse_args(argv)
    compile_eager = False if args.no_compile else None
    harness.sweep_main(
        args,
        plot,
        lambda progress: run(
            args.device, quick=args.quick, progress=progress, compile_eager=compile_eager
        ),
        desc="moe sweep",
    )


if __name__ == "__main__":
    main()
