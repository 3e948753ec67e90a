"""End-to-end timing of the Transformer LM: forward, forward + backward, or a full train step.

Each case builds a fresh model with random weights, runs ``--warmup`` untimed steps, then
``--steps`` timed ones. The device is synchronized after each phase (forward, backward,
optimizer), so every phase's time is its own; the tables give the median (p50) and the p20-p80
range per phase, and tokens per second, model FLOPs utilization (MFU: matmul FLOPs of the step
over the GPU's dense peak, named in the ``config`` column; see
``llmsys.profiling.infra.accounting``) and speed-up over the first provider, all three from the
median step, so one slow step moves none of them. Peak memory, too.
``forward`` runs under ``torch.no_grad()`` (inference); the other modes keep the graph.
Sizes, contexts, precisions, presets and warm-up counts sweep (several values each); a case that
runs out of memory is recorded as OOM and the sweep goes on. ``--warmup 0 1 2 5`` shows the
warm-up effect: the first steps pay for CUDA context setup, cuBLAS heuristics, Triton and
``torch.compile`` compilation.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import record_function

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int

from .infra import accounting
from .model import TransformerLM, use_int8_linears
from .options import (
    Variant,
    add_model_arguments,
    fill_device_defaults,
    variants,
)
from .progress import progress
from .training import (
    autocast,
    make_optimizer,
    random_batch,
    step_loss,
    synchronize,
    unless_out_of_memory,
)

HELP = "time forward / backward / optimizer steps of the Transformer LM (tokens/s, MFU, memory)"
MODES = ("forward", "forward-backward", "train-step")
PHASES = {"forward": ("forward",), "forward-backward": ("forward", "backward")}
PHASES["train-step"] = ("forward", "backward", "optimizer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--mode",
        nargs="+",
        default=["train-step"],
        choices=MODES,
        help="forward (no_grad), forward-backward, or train-step (with the optimizer)",
    )
    parser.add_argument(
        "--warmup", nargs="+", type=non_negative_int, default=[5], help="untimed steps first"
    )
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps")


class Runner:
    """One model, its optimizer and a batch, stepped phase by phase with synchronization."""

    def __init__(
        self,
        variant: Variant,
        size: str,
        context: int,
        batch: int,
        mode: str,
        device: torch.device | str,
    ) -> None:
        if variant.int8 and mode != "forward":
            raise ValueError("e2e: int8 linears are inference-only; use --mode forward")
        self.variant, self.mode, self.device = variant, mode, device
        self.config = variant.config(size, context)
        # The batch is drawn in range; the per-forward id check would add a synchronization.
        self.model = TransformerLM(self.config, device=device, check_tokens=False)
        if variant.int8:
            self.model = use_int8_linears(self.model.to(torch.bfloat16))
        self.call: Callable[..., Any] = self.model
        torch._dynamo.reset()  # a case pays its own compilation, and no graphs are left over
        if variant.compile:
            self.call = torch.compile(self.model, mode=variant.compile_mode)
        self.optimizer = (
            make_optimizer(self.model, variant.optimizer) if mode == "train-step" else None
        )
        self.tokens, self.targets = random_batch(self.config, batch, context, device)

    def step(self) -> dict[str, float]:
        """One step; milliseconds per phase, each phase in a profiler range of its name
        (``forward``, ``backward``, ``optimizer_step``)."""
        times, start = {}, time.perf_counter()

        def lap(phase: str) -> None:
            nonlocal start
            synchronize(self.device)
            now = time.perf_counter()
            times[phase], start = (now - start) * 1e3, now

        if self.variant.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # last step's graph outputs may go
        dtype = "fp32" if self.variant.int8 else self.variant.dtype  # int8 runs bf16 weights
        with record_function("forward"):
            with torch.set_grad_enabled(self.mode != "forward"), autocast(dtype, self.device):
                loss = step_loss(self.call, self.config, self.tokens, self.targets)
            lap("forward")
        if self.mode == "forward":
            return times
        with record_function("backward"):
            loss.backward()
            lap("backward")
        if self.optimizer is None:
            self.model.zero_grad(set_to_none=True)
            return times
        with record_function("optimizer_step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            lap("optimizer")
        return times


def measure(
    variant: Variant,
    size: str,
    context: int,
    batch: int,
    mode: str,
    device: torch.device | str,
    warmup: int,
    steps: int,
) -> dict[str, Any]:
    """Per-phase millisecond samples and peak memory (GiB, CUDA only) of one case."""
    runner = Runner(variant, size, context, batch, mode, device)
    for _ in range(warmup):
        runner.step()
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    samples = [runner.step() for _ in range(steps)]
    peak = None
    if torch.device(device).type == "cuda" and not variant.cuda_graphs:
        # A replayed CUDA graph's private memory pool is not in max_memory_allocated.
        peak = torch.cuda.max_memory_allocated(device) / 2**30
    return {"config": runner.config, "samples": samples, "peak_gib": peak}


def case_rows(
    variant: Variant,
    size: str,
    context: int,
    batch: int,
    mode: str,
    warmup: int,
    steps: int,
    device: torch.device | str,
    measured: dict[str, Any] | None,
    baseline_ms: float | None,
    warmup_in_case: bool = False,
) -> list[results.Row]:
    """A step row (tokens/s, MFU, memory) and one row per phase; ``warmup_in_case`` names the
    warm-up count in the case column (a warm-up sweep). Tokens/s, MFU and the speed-up over
    ``baseline_ms`` (the baseline's median step) come from the median step time."""
    gpu, stamp = results.device_name(device), results.timestamp()
    x = f"{size} ctx={context} batch={batch}" + (f" warmup={warmup}" if warmup_in_case else "")
    dtype = "bf16" if variant.int8 else variant.dtype  # int8 layers run on bf16 weights
    common: dict[str, Any] = dict(
        provider=variant.label, x=x, dtype=dtype, gpu=gpu, timestamp=stamp
    )
    compiled = f"{variant.compile}" + (f"/{variant.compile_mode}" if variant.compile else "")
    settings = f"warmup={warmup} steps={steps} compile={compiled} opt={variant.optimizer}"
    if measured is None:
        nan = float("nan")
        return [
            results.Row(kernel="transformer_lm", mode=mode, p20=nan, p50=nan, p80=nan,
                        config=f"OOM; {settings}", **common)
        ]  # fmt: skip
    samples = measured["samples"]
    step_ms = [sum(s.values()) for s in samples]
    p20, p50, p80 = results.quantiles(step_ms)
    tokens_per_s = batch * context / (p50 / 1e3)
    flops = accounting.step_flops(measured["config"], batch, context, mode)
    on_cuda = torch.device(device).type == "cuda"
    peak, peak_name = accounting.peak_flops(
        results.device_name(device), accounting.matmul_precision(dtype)
    )
    mfu = flops / (p50 / 1e3) / peak if peak and on_cuda else None
    memory = "" if measured["peak_gib"] is not None or not on_cuda else "; peak memory not"
    memory += " measured (CUDA graphs' private pool)" if memory else ""
    rows = [
        results.Row(
            kernel="transformer_lm",
            mode=mode,
            p20=p20,
            p50=p50,
            p80=p80,
            throughput=tokens_per_s,
            throughput_unit="tok/s",
            roofline_fraction=mfu,
            speedup_vs_baseline=baseline_ms / p50 if baseline_ms else None,
            config=f"{settings}; MFU of {peak_name}{memory}",
            mean=statistics.mean(step_ms),
            std=statistics.stdev(step_ms) if len(step_ms) > 1 else 0.0,
            memory_gib=measured["peak_gib"],
            **common,
        )
    ]
    for phase in PHASES[mode]:
        times = [s[phase] for s in samples]
        phase_p20, phase_p50, phase_p80 = results.quantiles(times)
        rows.append(
            results.Row(
                kernel=f"transformer_lm/{phase}",
                mode=mode,
                p20=phase_p20,
                p50=phase_p50,
                p80=phase_p80,
                config=settings,
                mean=statistics.mean(times),
                std=statistics.stdev(times) if len(times) > 1 else 0.0,
                **common,
            )
        )
    return rows


def run(args: argparse.Namespace) -> list[results.Row]:
    fill_device_defaults(args)
    cases = [
        (size, context, mode, dtype, warmup, variant)
        for size, context, mode, dtype, warmup in itertools.product(
            args.size, args.context_length, args.mode, args.dtype, args.warmup
        )
        for variant in variants(args, dtype)
    ]
    rows: list[results.Row] = []
    baselines: dict[tuple, float | None] = {}

    def label(case: tuple) -> str:
        size, context, mode, dtype, warmup, variant = case
        return f"{size} ctx={context} {mode} {dtype} warmup={warmup} {variant.label}"

    for size, context, mode, dtype, warmup, variant in progress(cases, "e2e", label):
        measured = unless_out_of_memory(
            lambda: measure(
                variant, size, context, args.batch_size, mode, args.device, warmup, args.steps
            ),
            args.device,
        )
        key = (size, context, mode, dtype, warmup)  # the first variant of a case is the baseline
        if key not in baselines:  # None when it ran out of memory: no speed-ups then
            baselines[key] = (
                statistics.median(sum(s.values()) for s in measured["samples"])
                if measured is not None
                else None
            )
        rows += case_rows(
            variant, size, context, args.batch_size, mode, warmup, args.steps, args.device,
            measured, baselines.get(key), warmup_in_case=len(args.warmup) > 1,
        )  # fmt: skip
    return rows
