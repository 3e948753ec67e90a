"""Where the host time of one call goes, step by step (issue 25's call-by-call profile).

    python packages/profiling/benchmarks/host_breakdown.py [--out DIR]

(with every package's src/ and tools/ on PYTHONPATH). Needs a CUDA GPU. For each call of the
host-cost table that misses its target, the whole call and each of its steps run alone, side by
side in one process (host microseconds per call, loops of 50 with no synchronize, medians of
21), beside what a user calls instead. A step is timed on inputs prepared outside the loop, so
the steps of a call add up to about the call. Every call has run three times (the first call
and two recordings) before it is timed, so its op replays its recorded plan
(``llmsys.triton_launch.plans``) as it does in a model. Writes ``host_breakdown_<gpu>.csv``
under DIR (default: results/ beside this file).
"""

from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.language as tl

from llmsys.bench_harness.harness import host_us_side_by_side
from llmsys.flash_attn2 import flash_attention
from llmsys.flash_attn2 import ops as flash_ops
from llmsys.kernels_int8 import Int8Linear
from llmsys.kernels_int8 import ops as int8_ops
from llmsys.kernels_swiglu import ops as swiglu_ops
from llmsys.kernels_swiglu import swiglu
from llmsys.triton_launch import launch, launcher, library, wants_grad


class _Identity(torch.autograd.Function):
    """No kernel at all: the host cost of a Python autograd.Function's forward and backward."""

    @staticmethod
    def forward(ctx, *inputs):
        return inputs[0].view_as(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        return (grad,) * len(ctx.needs_input_grad)


class _MinimalSwiGLU(torch.autograd.Function):
    """swiglu's two replayed ops in the least Python an ``autograd.Function`` allows: no
    ``wants_grad``, no double-backward test, no ``call_below_autograd``. What our own Python
    around the Function costs is the whole call minus this."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return library._impls[swiglu_ops.swiglu_fwd].below_autograd((a, b))

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return library._impls[swiglu_ops.swiglu_bwd].below_autograd((grad, a, b))


class AllocatingSwiGLU(torch.autograd.Function):
    """What swiglu's Function does with no kernel: saves its inputs, allocates its output in
    forward and both gradients in backward, launches nothing. The floor under any SwiGLU
    written as a Python ``autograd.Function``."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)


def swiglu_forward_launch(a: torch.Tensor):
    """swiglu's forward kernel for ``a`` (float32 math on CUDA, at the op's own launch
    configuration) as ``prepared(args)``, one ``launch`` with everything but the arguments
    decided; and the key parts ``launcher`` files its compiled kernel under."""
    n = a.numel()
    block, num_warps = swiglu_ops.launch_config(n)
    kernel = swiglu_ops.swiglu_fwd_kernel
    constexprs = {"COMPUTE_DTYPE": tl.float32, "PRECISE": True, "BLOCK_SIZE": block}
    grid = -(-n // block)

    def prepared(args: tuple) -> None:
        launch(kernel, grid, args, constexprs, num_warps=num_warps)

    return prepared, (kernel, a.get_device(), num_warps, None), constexprs, grid


def _entry(op):
    """The entry an op's calls go through (a native_plans.Plans where it could be built)."""
    return library._impls[op]


def swiglu_steps(dtype) -> dict:
    a, b = (torch.randn(128, 128, device="cuda", dtype=dtype) for _ in range(2))
    out = torch.empty_like(a)
    for _ in range(4):  # the first call, two recordings: then the plan
        swiglu(a, b)
    prepared, _, _, _ = swiglu_forward_launch(a)
    entry = _entry(swiglu_ops.swiglu_fwd)
    return {
        "eager F.silu(a) * b": lambda: F.silu(a) * b,
        "swiglu(), the whole call": lambda: swiglu(a, b),
        "step: wants_grad(a, b) (the public function's Python)": lambda: wants_grad(a, b),
        "step: the op's entry below autograd (C++: thread-state test, signature, plan)": (
            lambda: entry.below_autograd((a, b))
        ),
        "step: torch.empty_like(a)": lambda: torch.empty_like(a),
        "step: one llmsys launch (key, lookup, CompiledKernel.run)": lambda: prepared(
            (a, b, out, a.numel())
        ),
        "the op's Python impl (the path before a plan, and without C++)": lambda: (
            swiglu_ops._swiglu_fwd(a, b)
        ),
    }


_keep_alive = []


def op_by_name_steps() -> dict:
    """The op called by name: the dispatcher, torch's ``register_autograd`` kernel and our
    entry, each beside the others."""
    a, b = (torch.randn(128, 128, device="cuda") for _ in range(2))
    op = swiglu_ops.swiglu_fwd
    for _ in range(4):
        op(a, b)
    entry = _entry(op)
    lib = torch.library.Library("llmsys_breakdown", "FRAGMENT")
    _keep_alive.append(lib)  # a Library's ops are deregistered when it is collected
    lib.define("plain(Tensor a, Tensor b) -> Tensor")
    entry.register_kernel("llmsys_breakdown::plain", "CUDA")  # as define_op registers it
    lib.define("python_kernel(Tensor a, Tensor b) -> Tensor")
    lib.impl("python_kernel", entry, "CUDA")
    lib.define("allocate(Tensor a, Tensor b) -> Tensor")
    lib.impl("allocate", lambda a, b: torch.empty_like(a), "CUDA")
    torch.library.register_autograd(
        "llmsys_breakdown::allocate", lambda ctx, g: (g, g), setup_context=lambda *x: None, lib=lib
    )
    ops = torch.ops.llmsys_breakdown
    return {
        "eager F.silu(a) * b": lambda: F.silu(a) * b,
        "torch.ops.llm_scaling_week.swiglu_fwd, the whole call": lambda: op(a, b),
        "step: our entry called from Python (thread-state test, plan)": lambda: entry(a, b),
        "step: the entry as an op's C++ CUDA kernel, no autograd kernel (the dispatcher trip)": (
            lambda: ops.plain(a, b)
        ),
        "step: the same as a Python CUDA kernel (the trip before 0.7.0)": (
            lambda: ops.python_kernel(a, b)
        ),
        "step: torch.ops.aten.neg.default(a), an ATen op by the same route (alloc, launch)": (
            lambda: torch.ops.aten.neg.default(a)
        ),
        "step: torch's register_autograd kernel around an impl that only allocates": lambda: (
            ops.allocate(a, b)
        ),
        "step: torch.empty_like(a) (that impl)": lambda: torch.empty_like(a),
    }


def int8_steps(m: int, n: int) -> dict:
    linear = torch.nn.Linear(4096, n, bias=False, device="cuda", dtype=torch.float16)
    layer = Int8Linear.from_float(linear)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
    b, b_scale = layer.qweight.t(), layer.weight_scale
    with torch.no_grad():
        for _ in range(4):
            layer(x)
    entry = _entry(int8_ops.int8_matmul_quantize)
    return {
        "fp16 F.linear": lambda: F.linear(x, linear.weight),
        "Int8Linear forward, the whole call": lambda: layer(x),
        "step: Int8Linear's own checks and reshape": lambda: (
            x.requires_grad,
            x.shape[-1] == 4096,
            x.reshape(m, 4096),
        ),
        "step: qweight.t()": lambda: layer.qweight.t(),
        "step: the op's entry below autograd (C++: test, signature, 3 allocations, "
        "2 launches)": lambda: entry.below_autograd((x, b, b_scale, None)),
        "the op's Python impl (the path before a plan, and without C++)": lambda: (
            int8_ops.matmul_quantize(x, b, b_scale)
        ),
        "step: the same three allocations from Python": lambda: (
            torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format),
            x.new_empty((m,)),
            x.new_empty((m, n)),
        ),
    }


def flash_steps(shape) -> dict:
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = shape[-1] ** -0.5
    for _ in range(4):
        flash_attention(q, k, v, causal=True)
    entry = _entry(flash_ops.flash_attn2_fwd)
    return {
        "SDPA": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "flash_attention forward, the whole call": lambda: flash_attention(q, k, v, causal=True),
        "step: the op's entry below autograd (C++: test, signature, 2 allocations, launch)": (
            lambda: entry.below_autograd((q, k, v, True, scale))
        ),
        "the op's Python impl (the path before a plan, and without C++)": lambda: (
            flash_ops.flash_attn2_fwd_impl(q, k, v, True, scale)
        ),
    }


def launch_floor_steps() -> dict:
    """One launch of swiglu's forward kernel (128x128 fp32) by each route, beside one whole ATen
    op and its allocation: how much of a launch is the driver's."""
    a, b = (torch.randn(128, 128, device="cuda") for _ in range(2))
    out = torch.empty_like(a)
    swiglu(a, b)
    prepared, head, constexpr_dict, grid = swiglu_forward_launch(a)
    args = (a, b, out, a.numel())
    compiled = launcher._compiled[launcher._python_key(head, args, constexpr_dict)]
    stream = torch._C._cuda_getCurrentRawStream(a.get_device())
    meta = (compiled.function, compiled.packed_metadata, None, None, None)
    constexprs = tuple(constexpr_dict.values())
    return {
        "torch.mul(a, b): one whole ATen op (allocation, dispatch, launch)": lambda: torch.mul(
            a, b
        ),
        "torch.empty_like(a)": lambda: torch.empty_like(a),
        "one llmsys launch (device, hooks, key, lookup, CompiledKernel.run)": lambda: prepared(
            args
        ),
        "Triton's own launcher, CompiledKernel.run, same kernel": lambda: compiled.run(
            grid, 1, 1, stream, *meta, *args, *constexprs
        ),
        "step: the launcher's key alone": lambda: launcher._python_key(head, args, constexpr_dict),
        "step: the current-stream query": lambda: torch._C._cuda_getCurrentRawStream(
            a.get_device()
        ),
    }


def backward_steps(shape) -> dict:
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn_like(q)
    a, b = (
        torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    g = torch.randn_like(a)
    out, lse = flash_ops.flash_attn2_fwd_impl(q.detach(), k.detach(), v.detach(), True, 0.125)
    return {
        "SDPA forward+backward": lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), do
        ),
        "flash forward+backward, the whole call": lambda: torch.autograd.grad(
            flash_attention(q, k, v, causal=True), (q, k, v), do
        ),
        "step: the backward op's entry below autograd": lambda: _entry(
            flash_ops.flash_attn2_bwd
        ).below_autograd((do, q.detach(), k.detach(), v.detach(), out, lse, True, 0.125)),
        "step: a kernel-free autograd.Function of 3 inputs, forward+backward": lambda: (
            torch.autograd.grad(_Identity.apply(q, k, v), (q, k, v), do, allow_unused=True)
        ),
        "eager swiglu forward+backward 1024x1024 bf16": lambda: torch.autograd.grad(
            F.silu(a) * b, (a, b), g
        ),
        "swiglu forward+backward, the whole call": lambda: torch.autograd.grad(
            swiglu(a, b), (a, b), g
        ),
        "step: swiglu's two entries below autograd (forward, backward)": lambda: (
            _entry(swiglu_ops.swiglu_fwd).below_autograd((a.detach(), b.detach())),
            _entry(swiglu_ops.swiglu_bwd).below_autograd((g, a.detach(), b.detach())),
        ),
        "step: a kernel-free autograd.Function of 2 inputs, forward+backward": lambda: (
            torch.autograd.grad(_Identity.apply(a, b), (a, b), g, allow_unused=True)
        ),
        "step: the same two ops in a minimal autograd.Function (no wants_grad, no checks)": (
            lambda: torch.autograd.grad(_MinimalSwiGLU.apply(a, b), (a, b), g)
        ),
        "step: a Function that saves and allocates as swiglu's does, no kernel": (
            lambda: torch.autograd.grad(AllocatingSwiGLU.apply(a, b), (a, b), g)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    groups = {
        "one launch": launch_floor_steps(),
        "swiglu() 128x128 float32": swiglu_steps(torch.float32),
        "swiglu_fwd op by name 128x128 float32": op_by_name_steps(),
        "Int8Linear M 128, K 4096, N 4096": int8_steps(128, 4096),
        "Int8Linear M 4096, K 4096, N 4096": int8_steps(4096, 4096),
        "flash forward 1x16x1024x64 bf16 causal": flash_steps((1, 16, 1024, 64)),
        "forward+backward": backward_steps((1, 16, 1024, 64)),
    }
    gpu = torch.cuda.get_device_name()
    rows = []
    for group, steps in groups.items():
        times = host_us_side_by_side(list(steps.values()), calls=50, repeats=21)
        print(f"\n{group} ({gpu})")
        for name, us in zip(steps, times, strict=True):
            print(f"  {name:78} {us:8.1f} us")
            rows.append({"group": group, "step": name, "host_us": round(us, 2), "gpu": gpu})
    print(f"wrote {write_rows(rows, args.out, 'host_breakdown')}")


def rounds_in_changing_order(calls: dict, rounds: int, repeats: int) -> list[dict]:
    """Host microseconds per call of each of ``calls`` (name -> function), side by side, once per
    round: as listed, reversed, then shuffled, since the place in a round moved single results
    by 5-10% on the H100 hosts. Each call runs five times first (its first call, two
    recordings, then its plan). Returns one {name: us} per round."""
    for fn in calls.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    names, results = list(calls), []
    for r in range(rounds):
        shuffled = random.Random(r).sample(names, len(names))
        order = names if r == 0 else names[::-1] if r == 1 else shuffled
        times = host_us_side_by_side([calls[n] for n in order], calls=50, repeats=repeats)
        results.append(dict(zip(order, times, strict=True)))
    return results


def write_rows(rows: list[dict], out: Path, stem: str) -> Path:
    """Write ``rows`` as ``<stem>_<gpu>.csv`` under ``out`` (h100, h200, a100 or gpu, from the
    current device's name); returns the path."""
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name().lower()
    short = next((g for g in ("h100", "h200", "a100") if g in name), "gpu")
    path = out / f"{stem}_{short}.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


if __name__ == "__main__":
    main()
