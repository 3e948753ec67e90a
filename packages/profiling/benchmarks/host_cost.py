"""Host cost per call of the kernel packages' ops beside what a user calls instead (issues 12, 25).

    python packages/profiling/benchmarks/host_cost.py [--out DIR]

(with every package's src/ and tools/ on PYTHONPATH).
Needs a CUDA GPU. Three kinds of rows, all medians over repeats, in one process:

- ``host``: host microseconds per call, a loop of calls with no synchronize (the table of
  issue 12), ours beside the eager or library call a user would make instead;
- ``launch``: the same SwiGLU forward launched and registered in the alternative ways weighed
  in ``DECISIONS.md`` (kernel[grid], llmsys launch, custom_op, triton_op + wrap_triton,
  register_autograd);
- ``wall`` and ``graph``: int8 at decode, the four Qwen2.5-3B layer GEMMs with activation
  quantization at M = 1 and 16, back to back in eager mode (wall time per call) and replayed
  from a CUDA graph, against fp16 ``x @ w.T``.

Prints the table and writes it as ``host_cost_<gpu>.csv`` under DIR (default: results/ beside
this file); with ``LLMSYS_NATIVE_PLANS=0`` (ops run their Python impl on every call, the
fallback where the C++ module cannot be built) as ``host_cost_<gpu>_without_native_plans.csv``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from llmsys.bench_harness.harness import cuda_graph, host_us_side_by_side
from llmsys.flash_attn2 import flash_attention
from llmsys.kernels_int8 import Int8Linear, matmul_int8, matmul_quantize_int8, quantize_int8
from llmsys.kernels_int8 import quantize_int8_perrow as quantize_rows
from llmsys.kernels_moe import moe_unpermute, padded_moe_permute
from llmsys.kernels_swiglu import ops as swiglu_ops
from llmsys.kernels_swiglu import swiglu
from llmsys.kernels_swiglu.kernels import swiglu_fwd_kernel
from llmsys.triton_launch import call_below_autograd, launch

_keep_alive: list = []
QWEN_GEMMS = ((2048, 6144), (2048, 2048), (2048, 22016), (11008, 2048))  # (K, N)


def host_us(*fns) -> list[float]:
    """Median host microseconds per call of each of ``fns``, side by side, over loops of 50 calls
    with no synchronize (50: the largest GEMMs here must not fill the launch queue and turn the
    loop GPU-bound)."""
    return host_us_side_by_side(fns, calls=50, repeats=21)


def wall_us(fn, calls: int = 50, repeats: int = 21) -> float:
    """Median wall microseconds per call of ``calls`` calls back to back, synchronized once."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def graph_us(fn, calls: int = 50, repeats: int = 21) -> float:
    """Median wall microseconds per call of ``calls`` calls captured in one CUDA graph."""
    return wall_us(cuda_graph(fn, calls=calls, warmup=1), 1, repeats) / calls


# --- the alternatives for one SwiGLU forward (DECISIONS.md) ---------------------------------------


def _constexprs(block: int) -> dict:
    return {"COMPUTE_DTYPE": triton.language.float32, "PRECISE": True, "BLOCK_SIZE": block}


def _launch_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(a)
    block, warps = swiglu_ops.launch_config(a.numel())
    launch(
        swiglu_fwd_kernel,
        -(-a.numel() // block),
        (a, b, out, a.numel()),
        _constexprs(block),
        num_warps=warps,
    )
    return out


def _jit_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(a)
    block, warps = swiglu_ops.launch_config(a.numel())
    swiglu_fwd_kernel[(triton.cdiv(a.numel(), block),)](
        a, b, out, a.numel(), **_constexprs(block), num_warps=warps
    )
    return out


def alternatives() -> dict:
    """name -> callable(a, b), each registered under the namespace llmsys_alt."""
    found = {
        "swiglu() (the public function, our path)": swiglu,
        "swiglu_fwd's impl via call_below_autograd": partial(
            call_below_autograd, swiglu_ops.swiglu_fwd
        ),
        "kernel[grid], no op": _jit_impl,
        "llmsys launch, no op": _launch_impl,
    }
    lib = torch.library.Library("llmsys_alt", "FRAGMENT")
    _keep_alive.append(lib)  # a Library's ops are deregistered when it is collected
    lib.define("lean(Tensor a, Tensor b) -> Tensor")
    for device in ("CPU", "CUDA"):
        lib.impl("lean", _launch_impl, device)
    found["Library op + llmsys launch (the dispatcher trip)"] = torch.ops.llmsys_alt.lean

    lib.define("generic_autograd(Tensor a, Tensor b) -> Tensor")
    lib.impl("generic_autograd", _launch_impl, "CUDA")
    torch.library.register_autograd(
        "llmsys_alt::generic_autograd",
        lambda ctx, g: (g, g),
        setup_context=lambda *a: None,
        lib=lib,
    )
    found["Library op + register_autograd"] = torch.ops.llmsys_alt.generic_autograd

    custom = torch.library.custom_op("llmsys_alt::custom", _launch_impl, mutates_args=())
    found["custom_op + llmsys launch"] = custom

    if hasattr(torch.library, "triton_op"):

        def _triton_impl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(a)
            block, warps = swiglu_ops.launch_config(a.numel())
            torch.library.wrap_triton(swiglu_fwd_kernel)[(triton.cdiv(a.numel(), block),)](
                a, b, out, a.numel(), **_constexprs(block), num_warps=warps
            )
            return out

        found["triton_op + wrap_triton"] = torch.library.triton_op(
            "llmsys_alt::triton", _triton_impl, mutates_args=()
        )
    return found


# --- the rows -------------------------------------------------------------------------------------


def rows() -> list[dict]:
    out = []

    def row(kind, case, ours, baseline=None, target=None, baseline_name=None):
        entry = {
            "kind": kind,
            "case": case,
            "ours_us": round(ours, 2),
            "baseline": baseline_name or "",
        }
        if baseline is not None:
            entry |= {"baseline_us": round(baseline, 2), "ratio": round(ours / baseline, 3)}
        entry["target_ratio"] = target if target is not None else ""
        out.append(entry)
        print(
            f"{kind:6} {case:58} {ours:8.1f} us"
            + (
                f"  vs {baseline_name}: {baseline:8.1f} us  ({ours / baseline:.2f}x)"
                if baseline
                else ""
            ),
            flush=True,
        )

    def host_row(case, ours, baseline_name, baseline, target):
        row("host", case, *host_us(ours, baseline), target, baseline_name=baseline_name)

    cuda = {"device": "cuda"}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (torch.randn(128, 128, **cuda, dtype=dtype) for _ in range(2))
        name = str(dtype).removeprefix("torch.")
        ours_fn, by_name, eager = host_us(
            lambda: swiglu(a, b),
            lambda: torch.ops.llm_scaling_week.swiglu_fwd(a, b),
            lambda: F.silu(a) * b,
        )
        row("host", f"swiglu(), 128x128 {name}", ours_fn, eager, 0.75, "F.silu(a) * b")
        row("host", f"swiglu_fwd op by name, 128x128 {name}", by_name, eager, 0.9, "F.silu(a) * b")
    a, b = (torch.randn(128, 128, **cuda) for _ in range(2))
    found = alternatives()
    eager_swiglu, *costs = host_us(
        lambda: F.silu(a) * b, *(partial(fn, a, b) for fn in found.values())
    )
    for name, cost in zip(found, costs, strict=True):
        row(
            "launch",
            f"swiglu fwd 128x128 fp32: {name}",
            cost,
            eager_swiglu,
            baseline_name="F.silu(a) * b",
        )

    a, b, g = (torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    a.requires_grad_(), b.requires_grad_()
    host_row(
        "swiglu forward+backward 1024x1024 bf16 (autograd.grad)",
        lambda: torch.autograd.grad(swiglu(a, b), (a, b), g),
        "eager autograd",
        lambda: torch.autograd.grad(F.silu(a) * b, (a, b), g),
        1.0,
    )

    with torch.inference_mode():
        for n in (4096, 14336):
            linear = torch.nn.Linear(4096, n, bias=False, **cuda, dtype=torch.float16)
            int8_linear = Int8Linear.from_float(linear)
            for m in (128, 4096):
                x = torch.randn(m, 4096, **cuda, dtype=torch.float16)
                host_row(
                    f"Int8Linear forward, M = {m}, K 4096, N {n}",
                    lambda x=x, layer=int8_linear: layer(x),
                    "fp16 F.linear",
                    lambda x=x, w=linear.weight: F.linear(x, w),
                    1.5,
                )
            del linear, int8_linear
        x1 = torch.randn(1, 2048, device="cuda", dtype=torch.float16)
        row("host", "quantize_int8_perrow, M = 1, K 2048", *host_us(lambda: quantize_rows(x1)))
        w = torch.randn(22016, 2048, device="cuda", dtype=torch.float16) * 0.02  # (N, K)
        qw, w_scale = quantize_int8(w.t())
        qa, a_scale = quantize_rows(x1)
        row(
            "host",
            "matmul_int8, M = 1, K 2048, N 22016",
            *host_us(lambda: matmul_int8(qa, a_scale, qw, w_scale), lambda: x1 @ w.t()),
            baseline_name="fp16 a @ w",
        )
        for m in (1, 16, 16384):
            x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
            host_row(
                f"matmul_quantize_int8, M = {m}, K 2048, N 22016",
                lambda x=x: matmul_quantize_int8(x, qw, w_scale),
                "fp16 a @ w",
                lambda x=x: x @ w.t(),
                2.0,
            )
        del w, qw

    sdpa = F.scaled_dot_product_attention
    for heads, head_dim in ((16, 64), (32, 128)):
        shape = (1, heads, 1024, head_dim)
        q, k, v, do = (torch.randn(shape, **cuda, dtype=torch.bfloat16) for _ in range(4))
        case = "x".join(map(str, shape)) + " bf16 causal"
        with torch.no_grad():
            host_row(
                f"flash_attention forward, {case}",
                lambda q=q, k=k, v=v: flash_attention(q, k, v, causal=True),
                "SDPA",
                lambda q=q, k=k, v=v: sdpa(q, k, v, is_causal=True),
                1.0,
            )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        host_row(
            f"flash_attention forward+backward, {case}",
            lambda q=q, k=k, v=v, do=do: torch.autograd.grad(
                flash_attention(q, k, v, causal=True), (q, k, v), do
            ),
            "SDPA",
            lambda q=q, k=k, v=v, do=do: torch.autograd.grad(
                sdpa(q, k, v, is_causal=True), (q, k, v), do
            ),
            1.2,
        )
        del q, k, v, do

    topk, experts, hidden, align = 2, 8, 2048, 16
    for tokens in (64, 4096):
        xm = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        top = torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :topk]
        counts = torch.bincount(top.flatten(), minlength=experts)
        weights = torch.rand(tokens, topk, device="cuda", dtype=torch.bfloat16)
        rows_bound = tokens * topk + experts * (align - 1)
        perm, _, row_index = padded_moe_permute(
            xm, top, counts, topk, experts, align=align, out_rows=rows_bound, return_row_index=True
        )

        def eager_permute():
            order = top.flatten().argsort(stable=True)
            return xm[order // topk], order

        sorted_rows, order = eager_permute()
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device="cuda")

        def eager_unpermute():
            return (sorted_rows[inverse].view(tokens, topk, hidden) * weights[..., None]).sum(1)

        with torch.no_grad():
            host_row(
                f"moe permute, {tokens} tokens top-{topk} of {experts}, out_rows given",
                lambda: padded_moe_permute(
                    xm, top, counts, topk, experts, align=align, out_rows=rows_bound
                ),
                "eager argsort permute",
                eager_permute,
                1.0,
            )
            host_row(
                f"moe unpermute, {tokens} tokens top-{topk}",
                lambda: moe_unpermute(perm, row_index, weights),
                "eager gather + weighted sum",
                eager_unpermute,
                1.0,
            )

    with torch.inference_mode():
        for k_dim, n in QWEN_GEMMS:
            w = torch.randn(n, k_dim, device="cuda", dtype=torch.float16) * 0.02
            qw, w_scale = quantize_int8(w.t())
            for m in (1, 16):
                x = torch.randn(m, k_dim, device="cuda", dtype=torch.float16)
                ours = lambda x=x, qw=qw, s=w_scale: matmul_quantize_int8(x, qw, s)  # noqa: E731
                fp16 = lambda x=x, w=w: x @ w.t()  # noqa: E731
                case = f"int8 W8A8 M = {m}, K {k_dim}, N {n}"
                fp16_name = {"baseline_name": "fp16 x @ w.T"}
                row("wall", case, wall_us(ours), wall_us(fp16), 0.8, **fp16_name)
                row("graph", case, graph_us(ours), graph_us(fp16), 0.7, **fp16_name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_cost.py needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    gpu = next((g for g in ("h100", "h200", "a100") if g in name.lower()), "gpu")
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    table = rows()
    today = datetime.date.today().isoformat()
    plans = "on" if os.environ.get("LLMSYS_NATIVE_PLANS", "1") != "0" else "off"
    for entry in table:
        entry |= {"gpu": name, "torch": torch.__version__, "triton": triton.__version__}
        entry |= {"date": today, "native_plans": plans}
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if plans == "on" else "_without_native_plans"
    path = args.out / f"host_cost_{gpu}{suffix}.csv"
    fields = [
        "kind",
        "case",
        "ours_us",
        "baseline",
        "baseline_us",
        "ratio",
        "target_ratio",
        "gpu",
        "torch",
        "triton",
        "date",
        "native_plans",
    ]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fields, restval="")
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
