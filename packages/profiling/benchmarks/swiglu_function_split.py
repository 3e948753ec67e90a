"""Where SwiGLU forward+backward's host time goes inside a Python ``autograd.Function`` (issue 25).

    python packages/profiling/benchmarks/swiglu_function_split.py [--rounds 6] [--out DIR]

(with every package's src/ and tools/ on PYTHONPATH). Needs a CUDA GPU. ``torch.autograd.grad``
of 1024x1024 bf16 SwiGLU through Functions that differ in one side at a time: the floor (saves
its inputs, allocates its output and both gradients, launches nothing), our forward op or our
backward op in place of the floor's allocations, both (swiglu's Function without its checks),
the public ``swiglu()``, and an ATen op with the same allocations and launches in our op's
place (``torch.neg``: one in the forward, two in the backward), beside eager; and the same ops
called alone. If our op costs what the ATen op costs in the same place, the time above the
floor is the price of launching inside autograd, not of our code. Rounds in changing order, as
``swiglu_host_rounds.py``; writes ``swiglu_function_split_<gpu>.csv`` under DIR (default:
results/ beside this file).
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
from llmsys.kernels_swiglu import ops, swiglu
from llmsys.triton_launch import library


def _forward_op(a, b):
    return library._impls[ops.swiglu_fwd].below_autograd((a, b))


def _backward_op(grad, a, b):
    return library._impls[ops.swiglu_bwd].below_autograd((grad, a, b))


def _allocate_forward(a, b):
    return torch.empty_like(a)


def _allocate_backward(grad, a, b):
    return torch.empty_like(a), torch.empty_like(b)


def _function(forward, backward) -> type:
    """An ``autograd.Function`` that saves (a, b) and calls ``forward(a, b)`` and
    ``backward(grad, a, b)``."""

    class Split(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return forward(a, b)

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return backward(grad, a, b)

    return Split


def cases() -> dict:
    a, b, g = (torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a.requires_grad_(), b.requires_grad_()
    ad, bd = a.detach(), b.detach()
    functions = {
        "floor: saves and allocates, no kernel": (_allocate_forward, _allocate_backward),
        "our forward op, allocating backward": (_forward_op, _allocate_backward),
        "ATen torch.neg in the forward, allocating backward": (
            lambda a, b: torch.neg(a),
            _allocate_backward,
        ),
        "allocating forward, our backward op": (_allocate_forward, _backward_op),
        "allocating forward, two ATen torch.neg in the backward": (
            _allocate_forward,
            lambda grad, a, b: (torch.neg(a), torch.neg(b)),
        ),
        "both our ops (swiglu's Function without its checks)": (_forward_op, _backward_op),
    }
    calls = {"eager F.silu(a) * b": lambda: torch.autograd.grad(F.silu(a) * b, (a, b), g)}
    for name, (forward, backward) in functions.items():
        split = _function(forward, backward)
        calls[name] = lambda split=split: torch.autograd.grad(split.apply(a, b), (a, b), g)
    calls["swiglu(), the public function"] = lambda: torch.autograd.grad(swiglu(a, b), (a, b), g)
    calls["alone: our forward op"] = lambda: _forward_op(ad, bd)
    calls["alone: torch.neg"] = lambda: torch.neg(ad)
    calls["alone: our backward op"] = lambda: _backward_op(g, ad, bd)
    calls["alone: torch.neg twice"] = lambda: (torch.neg(ad), torch.neg(bd))
    calls["alone: torch.empty_like"] = lambda: torch.empty_like(ad)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=positive_int, default=6, help="rounds of all calls (default 6)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("swiglu_function_split.py needs a CUDA GPU")
    host_breakdown = load_beside(__file__, "host_breakdown")
    gpu, rows = torch.cuda.get_device_name(), []
    rounds = host_breakdown.rounds_in_changing_order(cases(), args.rounds, repeats=15)
    for r, times in enumerate(rounds):
        for n, us in times.items():
            rows.append({"round": r, "call": n, "host_us": round(us, 2), "gpu": gpu,
                         "date": datetime.date.today().isoformat()})  # fmt: skip
    for n in rounds[0]:
        median = statistics.median(times[n] for times in rounds)
        print(f"{n:58} median {median:7.1f} us")
    print(f"wrote {host_breakdown.write_rows(rows, args.out, 'swiglu_function_split')}")


if __name__ == "__main__":
    main()
