"""One-off GPU exploration behind the kernel's design choices (see NOTES.md for the outcome).

1. Exactness: which float32 silu formulation rounds to the same bfloat16/float16 as eager on
   every one of the 65536 input bit patterns.
2. Launch configuration: (BLOCK_SIZE, num_warps) per size for the forward and backward kernels.
3. Host cost of one call at 128x128 through each registration style.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import llmsys.kernels_swiglu as ks
from llmsys.kernels_swiglu import kernels, ops
from llmsys_bench import harness


@triton.jit
def silu_variants_kernel(a_ptr, out_ptr, n, VARIANT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    if VARIANT == 0:
        s = a / (1.0 + tl.exp(-a))
    elif VARIANT == 1:
        s = tl.div_rn(a, 1.0 + tl.exp(-a))
    elif VARIANT == 2:
        s = a * tl.sigmoid(a)
    elif VARIANT == 3:
        s = tl.div_rn(a, 1.0 + libdevice.exp(-a))
    else:
        s = a / (1.0 + libdevice.exp(-a))
    tl.store(out_ptr + offs, s.to(out_ptr.dtype.element_ty), mask=mask)


def exactness():
    names = [
        "a/(1+exp(-a))",
        "div_rn(a,1+exp(-a))",
        "a*sigmoid(a)",
        "div_rn(a,1+libdevice.exp)",
        "a/(1+libdevice.exp)",
    ]
    for dtype in (torch.bfloat16, torch.float16):
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        a = bits.view(dtype).cuda()
        a = a[torch.isfinite(a)]
        ref = F.silu(a)
        for v, name in enumerate(names):
            out = torch.full_like(a, float("nan"))
            silu_variants_kernel[(triton.cdiv(a.numel(), 1024),)](
                a, out, a.numel(), VARIANT=v, BLOCK=1024
            )
            bad = ~((out == ref) | (out.isnan() & ref.isnan()))
            print(f"exact {dtype}: {name:28} mismatches {int(bad.sum())} of {a.numel()}")
        b = torch.randn_like(a)
        ours = ks.swiglu(a, b)
        eq = torch.equal(ours, F.silu(a) * b)
        close = torch.allclose(ours, F.silu(a) * b)
        print(f"exact {dtype}: package swiglu equal={eq} allclose={close}")


def tuning():
    configs = [(512, 4), (1024, 2), (1024, 4), (2048, 8), (4096, 8), (8192, 16), (16384, 32)]
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26):
            a, b, g = (torch.randn(n, device="cuda", dtype=dtype) for _ in range(3))
            out, da, db = (torch.empty_like(a) for _ in range(3))
            copy = harness.time_ms(lambda: out.copy_(a))[1]
            line = []
            for block, warps in configs:
                grid = (triton.cdiv(n, block),)
                comp = tl.float32
                f = harness.time_ms(
                    lambda: kernels.swiglu_fwd_kernel[grid](
                        a,
                        b,
                        out,
                        n,
                        COMPUTE_DTYPE=comp,
                        PRECISE=True,
                        BLOCK_SIZE=block,
                        num_warps=warps,
                    )
                )[1]
                bw = harness.time_ms(
                    lambda: kernels.swiglu_bwd_kernel[grid](
                        g,
                        a,
                        b,
                        da,
                        db,
                        n,
                        COMPUTE_DTYPE=comp,
                        PRECISE=True,
                        BLOCK_SIZE=block,
                        num_warps=warps,
                    )
                )[1]
                line.append(f"{block}/{warps}: f{f * 1e3:7.1f} b{bw * 1e3:7.1f}")
            eager = harness.time_ms(lambda: F.silu(a) * b)[1]
            print(
                f"tune {dtype!s:15} n=2^{n.bit_length() - 1}: eager {eager * 1e3:7.1f}us "
                f"copy(2 tensors) {copy * 1e3:7.1f}us | " + " | ".join(line)
            )


def host_cost():
    a = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    lib = torch.library.Library("llmsys_explore", "DEF")
    lib.define("swiglu_noautograd(Tensor a, Tensor b) -> Tensor")
    lib.impl("swiglu_noautograd", ops._swiglu_fwd, "CUDA")
    torch.empty_like(a)
    n = a.numel()
    comp = tl.float32

    def plain_triton():
        o = torch.empty_like(a)
        kernels.swiglu_fwd_kernel[(16,)](
            a, b, o, n, COMPUTE_DTYPE=comp, PRECISE=True, BLOCK_SIZE=1024, num_warps=4
        )
        return o

    torch.ops.llm_scaling_week.swiglu_fwd(a, b)  # compile and cache the launcher
    out = torch.empty_like(a)
    (compiled,) = [
        kernel
        for key, kernel in ops._compiled.items()
        if key[0] is kernels.swiglu_fwd_kernel
        and key[1] == a.dtype
        and key[3:7] == (1024, True, False, False)
    ]
    stream = torch._C._cuda_getCurrentRawStream(0)

    def raw_run():
        compiled.run(
            16,
            1,
            1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            a,
            b,
            out,
            n,
            tl.float32,
            True,
            1024,
        )

    def key_parts():
        return (
            a.dtype,
            0,
            1024,
            n % 16 == 0,
            n == 1,
            n >= 2**31,
            *[t.data_ptr() % 16 == 0 for t in (a, b, out)],
        )

    variants = {
        "eager silu(a)*b": lambda: F.silu(a) * b,
        "torch.ops swiglu_fwd (package)": lambda: torch.ops.llm_scaling_week.swiglu_fwd(a, b),
        "torch.ops swiglu_fwd.default (package)": lambda: (
            torch.ops.llm_scaling_week.swiglu_fwd.default(a, b)
        ),
        "torch.ops without autograd kernel": lambda: torch.ops.llmsys_explore.swiglu_noautograd(
            a, b
        ),
        "python impl called directly (cached launch)": lambda: ops._swiglu_fwd(a, b),
        "_launch alone": lambda: ops._launch(kernels.swiglu_fwd_kernel, (a, b, out), n),
        "compiled.run alone": raw_run,
        "key building": key_parts,
        "current_device + hooks check": lambda: (
            torch.cuda.current_device(),
            ops._launch_hooks_installed(),
        ),
        "plain triton launch + empty_like": plain_triton,
        "empty_like alone": lambda: torch.empty_like(a),
        "eager F.silu alone": lambda: F.silu(a),
    }
    results = {name: [] for name in variants}
    for _ in range(5):
        for name, fn in variants.items():
            results[name].append(harness.host_us_per_call(fn, calls=1000, repeats=3))
    for name, values in results.items():
        values.sort()
        print(f"host {name:45} median {values[2]:6.2f} min {values[0]:6.2f} us/call")


def fwd_bwd_host():
    """Is fwd+bwd host-bound? Host us of one autograd step, and do_bench with and without it."""
    for shape in [(128, 128), (4096, 4096)]:
        a = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn_like(a, requires_grad=True)
        g = torch.randn_like(a)
        steps = {
            "eager": lambda: (F.silu(a) * b).backward(g),
            "ours": lambda: ks.swiglu(a, b).backward(g),
            "ours bwd op alone": lambda: torch.ops.llm_scaling_week.swiglu_bwd(g, a, b),
        }
        for name, step in steps.items():
            host = harness.host_us_per_call(step, calls=200, repeats=3)
            device = harness.time_ms(step, grad_to_none=[a, b])[1] * 1e3
            print(f"fwdbwd {shape} {name:18} host {host:7.1f} us/step  do_bench {device:7.1f} us")


def fwd_bwd_breakdown():
    """Where does a small fwd+bwd step's host time go? (128x128 bf16)"""
    a = torch.randn(128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(a, requires_grad=True)
    g = torch.randn_like(a)

    class EagerFunction(torch.autograd.Function):  # Python Function overhead, eager math
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return F.silu(a) * b

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return ops.swiglu_backward_reference(grad, a, b)

    class DirectFunction(torch.autograd.Function):  # our kernels, no dispatcher in between
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return ops._swiglu_fwd(a, b)

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return ops._swiglu_bwd(grad, a, b)

    out_eager = F.silu(a) * b
    out_ours = ks.swiglu(a, b)
    steps = {
        "eager fwd (graph built)": lambda: F.silu(a) * b,
        "ours fwd (graph built)": lambda: ks.swiglu(a, b),
        "eager backward only": lambda: out_eager.backward(g, retain_graph=True),
        "ours backward only": lambda: out_ours.backward(g, retain_graph=True),
        "EagerFunction fwd+bwd": lambda: EagerFunction.apply(a, b).backward(g),
        "DirectFunction fwd+bwd": lambda: DirectFunction.apply(a, b).backward(g),
        "ours fwd+bwd": lambda: ks.swiglu(a, b).backward(g),
        "eager fwd+bwd": lambda: (F.silu(a) * b).backward(g),
        "_swiglu_bwd direct, no grad": lambda: ops._swiglu_bwd(g, a.detach(), b.detach()),
        "swiglu_bwd op, no grad": lambda: torch.ops.llm_scaling_week.swiglu_bwd(
            g, a.detach(), b.detach()
        ),
    }
    for name, step in steps.items():
        host = harness.host_us_per_call(step, calls=200, repeats=3)
        print(f"breakdown {name:30} host {host:7.1f} us")


@triton.jit
def fwd_variant_kernel(
    a_ptr, b_ptr, out_ptr, n, EVICT: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr
):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    if EVICT:
        a = tl.load(a_ptr + offsets, mask=offsets < n, eviction_policy="evict_first")
        b = tl.load(b_ptr + offsets, mask=offsets < n, eviction_policy="evict_first")
    else:
        a = tl.load(a_ptr + offsets, mask=offsets < n)
        b = tl.load(b_ptr + offsets, mask=offsets < n)
    out = kernels._swiglu_fwd_math(a, b, out_ptr.dtype.element_ty, tl.float32, PRECISE)
    tl.store(out_ptr + offsets, out, mask=offsets < n)


def large_variants():
    """Why is Liger ~2% faster than ours on large bfloat16 tensors?"""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    for dtype in (torch.bfloat16, torch.float32):
        for n in (1 << 26, 1 << 27):
            a, b = (torch.randn(n // 8192, 8192, device="cuda", dtype=dtype) for _ in range(2))
            out = torch.empty_like(a)
            line = [
                f"liger {harness.time_ms(lambda: LigerSiLUMulFunction.apply(a, b))[1] * 1e3:6.1f}"
            ]
            line.append(f"ours-op {harness.time_ms(lambda: ks.swiglu(a, b))[1] * 1e3:6.1f}")
            for evict, precise, block, warps in [
                (True, True, 2048, 8),
                (False, True, 2048, 8),
                (True, False, 2048, 8),
                (False, False, 2048, 8),
                (False, True, 4096, 8),
                (False, True, 8192, 16),
                (False, True, 8192, 32),
            ]:
                grid = (triton.cdiv(n, block),)
                ms = harness.time_ms(
                    lambda: fwd_variant_kernel[grid](
                        a, b, out, n, EVICT=evict, PRECISE=precise, BLOCK=block, num_warps=warps
                    )
                )[1]
                line.append(f"e{int(evict)}p{int(precise)} {block}/{warps} {ms * 1e3:6.1f}")
            print(f"large {dtype} 2^{n.bit_length() - 1}: " + " | ".join(line))


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    parts = sys.argv[1:] or ["exactness", "host_cost", "fwd_bwd_host", "tuning"]
    for part in parts:
        globals()[part]()
