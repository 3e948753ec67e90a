"""Where a compiled Hugging Face Llama train step's GPU time goes, kernel by kernel.

The 0.85B Llama of ``llmsys-bench llama`` at 4 x 2048 tokens, bf16 autocast, fused AdamW, the loss
from ``labels=``, with a provider's kernels (stock, llmsys or liger), under ``torch.compile``:
three steps under the PyTorch profiler, their kernels summed by category (cuBLAS GEMMs, attention,
optimizer, llmsys kernels, inductor's kernels, copies) and the longest kernels listed, beside the
step time from CUDA events. Needs a CUDA GPU and transformers.

    python packages/profiling/benchmarks/llama_step_profile.py --provider llmsys
"""

from __future__ import annotations

import argparse
import collections
import copy
import re

import torch

from llmsys.profiling.llama import LLAMA, TRAIN_PROVIDERS, build_llama, kernels_of, train_step
from llmsys.profiling.training import make_optimizer

CATEGORIES = (  # (name, kernel-name pattern); the first match wins
    # attention first: cuDNN's attention kernels are named "..._sdpa_sm90_flash_..."
    ("attention", r"flash|attn|fmha|attention"),
    ("gemm (cuBLAS/CUTLASS)", r"gemm|nvjet|cutlass|xmma|sm90_|cublas|splitK"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("llmsys fused", r"rms_norm|rotary|cross_entropy_rows|swiglu"),
    ("inductor triton", r"^triton_"),
    ("copies/elementwise", r"elementwise|copy|fill|reduce|vectorized|unrolled|Memcpy|Memset|cat"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=TRAIN_PROVIDERS, default="llmsys")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    args = parser.parse_args()
    master = build_llama(LLAMA, "cpu", torch.float32).train()
    data = torch.randint(0, LLAMA["vocab_size"], (4, 2048), device="cuda")
    with kernels_of(args.provider, copy.deepcopy(master).cuda()) as model:
        call = torch.compile(model)
        optimizer = make_optimizer(model)
        for _ in range(4):  # compile and warm up
            train_step(call, optimizer, data, "cuda")
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                train_step(call, optimizer, data, "cuda")
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            train_step(call, optimizer, data, "cuda")
        end.record()
        torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / args.steps
    per_kernel, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / 1e3 / args.steps
            calls[event.name] += 1
    per_category = collections.Counter()
    for name, ms in per_kernel.items():
        category = next((c for c, rx in CATEGORIES if re.search(rx, name, re.I)), "other")
        per_category[category] += ms
    busy = sum(per_kernel.values())
    print(
        f"{args.provider} compiled: step {step_ms:.1f} ms (CUDA events), GPU kernel time "
        f"{busy:.1f} ms/step, idle {step_ms - busy:.1f} ms"
    )
    for category, ms in per_category.most_common():
        print(f"  {category:24s} {ms:7.2f} ms  {100 * ms / step_ms:5.1f}%")
    print("top kernels:")
    for name, ms in per_kernel.most_common(18):
        print(f"  {ms:7.2f} ms  {calls[name] // args.steps:4d}/step  {name[:110]}")


if __name__ == "__main__":
    main()
