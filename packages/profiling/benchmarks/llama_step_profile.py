"""Where a Hugging Face Llama step's GPU time goes, kernel by kernel.

A train step (``--case train``, the default): the 0.85B Llama of ``llmsys-bench llama`` at
4 x 2048 tokens, bf16 autocast, fused AdamW, the loss from ``labels=``, with a training
provider's kernels (stock, llmsys or liger), under ``torch.compile``.

A serving step (``--case decode`` or ``prefill``): ``llmsys-bench serve``'s model (``--model``,
default 8b) with a serving provider (fp16, int8-fused, torchao-int8, torchao-float8), eagerly or
with compiled decoder layers (``--compiled``): one decode step of ``--batch`` sequences over a
static cache of ``--context`` tokens, or one prefill of ``--batch`` x ``--tokens``. Beside the
eager step time it gives the step's time replayed from a CUDA graph, which has no host gaps.

Three steps run under the PyTorch profiler; their kernels are summed by category (cuBLAS GEMMs,
attention, optimizer, llmsys kernels, inductor's kernels, copies) and the longest kernels listed,
with their launches per step. Needs a CUDA GPU and transformers.

    python packages/profiling/benchmarks/llama_step_profile.py --provider llmsys
    python packages/profiling/benchmarks/llama_step_profile.py --case decode --provider int8-fused

``--summarize REPORT...`` writes reports printed earlier (saved to files) to stdout as one CSV,
without measuring: a row per step time and per category of each report; with ``--kernels``, a
row per kernel each report lists, with the category today's patterns give it and its time per
launch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import csv
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from llmsys.bench_harness import cuda_graph
from llmsys.bench_harness.arguments import positive_int
from llmsys.profiling import serve
from llmsys.profiling.llama import LLAMA, TRAIN_PROVIDERS, build_llama, kernels_of, train_step
from llmsys.profiling.training import make_optimizer

CATEGORIES = (  # (name, kernel-name pattern); the first match wins
    # attention first: cuDNN's attention kernels are named "..._sdpa_sm90_flash_..."
    ("attention", r"flash|attn|fmha|attention"),
    ("gemm (cuBLAS/CUTLASS, our W8A8)", r"gemm|nvjet|cutlass|xmma|sm90_|cublas|splitK|gemv|w8a8"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("llmsys int8", r"int8|quantize"),
    ("llmsys fused", r"rms_norm|rotary|cross_entropy_rows|swiglu"),
    ("inductor triton", r"^triton_"),
    ("copies/elementwise", r"elementwise|copy|fill|reduce|vectorized|unrolled|Memcpy|Memset|cat"),
)


def category_of(kernel: str) -> str:
    return next((c for c, rx in CATEGORIES if re.search(rx, kernel, re.I)), "other")


def events_ms(fn: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls, CUDA events around them all."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def report(label: str, fn: Callable[[], object], steps: int, graph_ms: float | None) -> None:
    """Profile ``steps`` calls of ``fn`` (warmed up) and print where their GPU time goes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    step_ms = events_ms(fn, steps)
    per_kernel, calls = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / 1e3 / steps
            calls[event.name] += 1
    per_category = collections.Counter()
    for name, ms in per_kernel.items():
        per_category[category_of(name)] += ms
    busy = sum(per_kernel.values())
    graph = f"; as a CUDA graph {graph_ms:.2f} ms" if graph_ms else ""
    print(
        f"{label}: step {step_ms:.2f} ms (CUDA events){graph}; GPU kernel time {busy:.2f} "
        f"ms/step in {sum(calls.values()) // steps} kernels, idle {step_ms - busy:.2f} ms"
    )
    for category, ms in per_category.most_common():
        print(f"  {category:24s} {ms:7.3f} ms  {100 * ms / step_ms:5.1f}%")
    print("top kernels:")
    for name, ms in per_kernel.most_common(24):
        print(f"  {ms:7.3f} ms  {calls[name] // steps:4d}/step  {name[:110]}")


# The lines report() prints: its first, each category's and each top kernel's.
STEP = re.compile(
    r"(?P<profile>.+?): step (?P<step>[\d.]+) ms \(CUDA events\)"
    r"(?:; as a CUDA graph (?P<graph>[\d.]+) ms)?[;,] GPU kernel time (?P<busy>[\d.]+) ms/step"
    r"(?: in (?P<kernels>\d+) kernels)?, idle (?P<idle>[\d.]+) ms"
)
CATEGORY = re.compile(r"  (?P<name>\S.*?) +(?P<ms>[\d.]+) ms +[\d.]+%")
KERNEL = re.compile(r" +(?P<ms>[\d.]+) ms +(?P<launches>\d+)/step  (?P<name>.+)")
STEP_FIELDS = ("report", "profile", "part", "name", "time_ms", "launches_per_step")
KERNEL_FIELDS = ("report", "profile", "kernel", "category", "time_ms", "launches_per_step",
                 "per_launch_us")  # fmt: skip


def report_lines(report: str) -> Iterator[tuple[str, str, re.Match[str]]]:
    """(profile, kind, match) for each line of the reports :func:`report` printed in ``report``:
    kind "step", "category" or "kernel". Any other line (a note added to the file) is skipped."""
    profile, listing = "", False
    for line in report.splitlines():
        if step := STEP.fullmatch(line):
            profile, listing = step["profile"], False
            yield profile, "step", step
        elif line == "top kernels:":
            listing = True
        elif match := (KERNEL if listing else CATEGORY).fullmatch(line):
            yield profile, "kernel" if listing else "category", match


STEP_PARTS = (("step (CUDA events)", "step"), ("CUDA graph replay", "graph"),
              ("GPU kernel time", "busy"), ("GPU idle", "idle"))  # fmt: skip


def summary_rows(report: str, name: str) -> Iterator[dict]:
    """CSV rows of the step times (part "step") and category totals ("category", as the report
    filed them) of the reports in ``report`` (``name``: where they were saved)."""
    for profile, kind, match in report_lines(report):
        row = {"report": name, "profile": profile, "part": kind}
        if kind == "step":
            for part, group in STEP_PARTS:
                time, launches = match[group], match["kernels"] if group == "busy" else None
                if time is not None:
                    yield {**row, "name": part, "time_ms": time, "launches_per_step": launches}
        elif kind == "category":
            yield {**row, "name": match["name"], "time_ms": match["ms"]}


def kernel_rows(report: str, name: str) -> Iterator[dict]:
    """CSV rows of the kernels the reports in ``report`` list: each with the category today's
    patterns give it and its time per launch."""
    for profile, kind, match in report_lines(report):
        if kind != "kernel":
            continue
        launches = int(match["launches"])
        yield {"report": name, "profile": profile, "kernel": match["name"],
               "category": category_of(match["name"]), "time_ms": match["ms"],
               "launches_per_step": launches,
               "per_launch_us": f"{float(match['ms']) * 1e3 / launches:.4g}"}  # fmt: skip


def summarize(paths: list[Path], kernels: bool) -> None:
    """The reports saved at ``paths`` as one CSV to stdout: their steps and categories, or the
    kernels they list."""
    rows, fields = (kernel_rows, KERNEL_FIELDS) if kernels else (summary_rows, STEP_FIELDS)
    writer = csv.DictWriter(sys.stdout, fields, lineterminator="\n")
    writer.writeheader()
    for path in paths:
        writer.writerows(rows(path.read_text(), path.name))


def train(args) -> None:
    master = build_llama(LLAMA, "cpu", torch.float32).train()
    data = torch.randint(0, LLAMA["vocab_size"], (4, 2048), device="cuda")
    with kernels_of(args.provider, copy.deepcopy(master).cuda()) as model:
        call = torch.compile(model)
        optimizer = make_optimizer(model)

        def step():
            train_step(call, optimizer, data, "cuda")

        for _ in range(4):  # compile and warm up
            step()
        torch.cuda.synchronize()
        report(f"{args.provider} compiled", step, args.steps, None)


def serving(args) -> None:
    if args.compiled:
        serve.allow_a_compile_per_layer()
    fp16 = build_llama(serve.MODELS[args.model], "cuda", torch.float16).eval()
    model = serve.quantized(args.provider, fp16)
    vocab = model.config.vocab_size
    with torch.no_grad():
        for batch in args.batch:
            if args.case == "prefill":
                ids = torch.randint(0, vocab, (batch, args.tokens), device="cuda")

                def step(ids=ids):
                    return model(ids, use_cache=False, logits_to_keep=1)

                size = f"{batch}x{args.tokens}"
            else:  # the cache filled eagerly, as serve does: no compile of that shape
                step = serve.decode_step(model, batch, args.context, room=16 + 3 * args.steps)
                size = f"batch {batch}, context {args.context}"
            compiled = serve.compiled_layers(model) if args.compiled else contextlib.nullcontext()
            with compiled:
                for _ in range(3):
                    step()
                graph_ms = None  # torchao's dynamic quantization does not capture (serve.NO_GRAPH)
                if not args.provider.startswith("torchao"):
                    graph_ms = events_ms(cuda_graph(step), args.steps)
                mode = "compiled layers" if args.compiled else "eager"
                label = f"{args.model} {args.case} {size}, {args.provider}, {mode}"
                report(label, step, args.steps, graph_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("train", "prefill", "decode"), default="train")
    parser.add_argument(
        "--provider",
        choices=(*TRAIN_PROVIDERS, *serve.PROVIDERS),
        default=None,
        help="train: stock, llmsys or liger (default llmsys); prefill and decode: fp16, "
        "int8-fused, torchao-int8 or torchao-float8 (default int8-fused)",
    )
    parser.add_argument("--model", choices=serve.MODELS, default="8b", help="serving model")
    parser.add_argument(
        "--batch", type=positive_int, nargs="+", default=[8], help="serving batches (default 8)"
    )
    parser.add_argument(
        "--tokens", type=positive_int, default=512, help="prefill tokens (default 512)"
    )
    parser.add_argument(
        "--context", type=positive_int, default=1024, help="decode context (default 1024)"
    )
    parser.add_argument("--compiled", action="store_true", help="serving: compile the layers")
    parser.add_argument("--steps", type=positive_int, default=3, help="profiled steps (default 3)")
    parser.add_argument(
        "--summarize", type=Path, nargs="+", metavar="REPORT",
        help="reports printed earlier, saved to files: their steps and categories as one CSV "
        "to stdout, nothing measured",
    )  # fmt: skip
    parser.add_argument("--kernels", action="store_true",
                        help="with --summarize: the kernels the reports list instead")  # fmt: skip
    args = parser.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.kernels)
        return
    training = args.case == "train"
    args.provider = args.provider or ("llmsys" if training else "int8-fused")
    if (args.provider in TRAIN_PROVIDERS) != training:
        parser.error(f"--provider {args.provider} does not serve --case {args.case}")
    if training:
        train(args)
    else:
        serving(args)


if __name__ == "__main__":
    main()
