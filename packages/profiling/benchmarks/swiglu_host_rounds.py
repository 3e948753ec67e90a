"""SwiGLU host time against eager over rounds in changing order (issue 25's two closest calls).

    python packages/profiling/benchmarks/swiglu_host_rounds.py [--rounds 4] [--out DIR]

(with every package's src/ and tools/ on PYTHONPATH). Needs a CUDA GPU. The calls, each with
the eager call it is compared with, as in ``host_cost.py``: ``torch.autograd.grad`` of 1024x1024
bf16 SwiGLU through the public ``swiglu()``, through its ``autograd.Function`` applied
directly, and through a Function that saves and allocates as it does but launches nothing (the
floor of any Python ``autograd.Function``), against ``F.silu(a) * b``; the forward alone at
that size; and the 128x128 float32 forward through ``swiglu()`` and through
``torch.ops.llm_scaling_week.swiglu_fwd`` by name.
Each round times them side by side (host microseconds per call, loops of 50 without a
synchronize, medians of 21) in an order of its own (as listed, reversed, then shuffled), because
the place in the round moved single results by 5-10% on the H100 hosts. Writes
``swiglu_host_rounds_<gpu>.csv`` under DIR (default: results/ beside this file) and prints each
round and the median ratio to eager.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from llmsys.bench_harness.arguments import positive_int
from llmsys.bench_harness.harness import load_beside
from llmsys.kernels_swiglu import swiglu
from llmsys.kernels_swiglu.functional import _SwiGLUFunction


def cases(host_breakdown) -> dict:
    """name -> (call, the name of the eager call it is compared with)."""
    a, b, g = (torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a.requires_grad_(), b.requires_grad_()
    x, y = (torch.randn(128, 128, device="cuda") for _ in range(2))
    by_name = torch.ops.llm_scaling_week.swiglu_fwd
    eager, eager_fwd, eager_small = "eager fwd+bwd", "eager fwd", "eager fwd 128x128 fp32"
    return {
        eager: (lambda: torch.autograd.grad(F.silu(a) * b, (a, b), g), eager),
        "swiglu() fwd+bwd": (lambda: torch.autograd.grad(swiglu(a, b), (a, b), g), eager),
        "its autograd.Function, applied directly, fwd+bwd": (
            lambda: torch.autograd.grad(_SwiGLUFunction.apply(a, b), (a, b), g),
            eager,
        ),
        "a Function that saves and allocates as swiglu's does, no kernel, fwd+bwd": (
            lambda: torch.autograd.grad(host_breakdown.AllocatingSwiGLU.apply(a, b), (a, b), g),
            eager,
        ),
        eager_fwd: (lambda: F.silu(a) * b, eager_fwd),
        "swiglu() fwd": (lambda: swiglu(a, b), eager_fwd),
        eager_small: (lambda: F.silu(x) * y, eager_small),
        "swiglu() fwd 128x128 fp32": (lambda: swiglu(x, y), eager_small),
        "swiglu_fwd by name 128x128 fp32": (lambda: by_name(x, y), eager_small),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=positive_int, default=4, help="rounds of all calls (default 4)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("swiglu_host_rounds.py needs a CUDA GPU")
    host_breakdown = load_beside(__file__, "host_breakdown")
    calls = cases(host_breakdown)
    names, gpu, rows = list(calls), torch.cuda.get_device_name(), []
    timed = {n: fn for n, (fn, _) in calls.items()}
    for r, got in enumerate(host_breakdown.rounds_in_changing_order(timed, args.rounds, 21)):
        print(f"round {r}: " + "; ".join(f"{n} {got[n]:.1f} us" for n in names), flush=True)
        order = list(got)  # (the order the round ran in)
        for n in names:
            eager = got[calls[n][1]]
            rows.append({"round": r, "call": n, "host_us": round(got[n], 2), "position":
                         order.index(n), "ratio_to_eager": round(got[n] / eager, 3), "gpu": gpu,
                         "date": datetime.date.today().isoformat()})  # fmt: skip
    for n in names:
        ratios = [row["ratio_to_eager"] for row in rows if row["call"] == n]
        print(f"{n:50} median ratio to eager {statistics.median(ratios):.3f} "
              f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip
    print(f"wrote {host_breakdown.write_rows(rows, args.out, 'swiglu_host_rounds')}")


if __name__ == "__main__":
    main()
