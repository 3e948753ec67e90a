"""Time per training step under each data-parallel strategy, one process per GPU: use torchrun.

    torchrun --nproc-per-node 2 strategies.py --out steps.csv     # xl, context 512, batch 4/GPU

The model is the profiling package's ``TransformerLM`` (xl: d_model 1600, d_ff 6400, 48 layers,
25 heads, vocab 10000; SDPA attention, SwiGLU), trained with bf16 autocast and fused AdamW on
random tokens. Every strategy runs in this one process group, one after another, on a freshly
built model: our four wrappers (bucketed at several sizes and with bf16 on the wire), torch's
``DistributedDataParallel`` (the anchor, default 25 MiB buckets, also with its bf16 compression
hook), and "no communication": each GPU training alone on the same per-GPU batch, the floor any
strategy can reach. Strategies take turns in ``--rounds`` rounds, so a host whose speed drifts
over minutes moves them all alike and their ratios hold.

Per strategy: the median step (from a barrier to the slowest rank's end), the exposed
communication (step minus the no-communication step), the GPU time of NCCL kernels in one
profiled step (communication overlapped or not), the host time to issue one step without
waiting for the GPU (an eager model this size at batch 4 is close to host-bound, so host cost
per collective matters) and the peak memory. Rank 0 writes the rows to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int
from llmsys.ddp import (
    DDPBucketed,
    DDPFlat,
    DDPIndividualParameters,
    DDPNaive,
    init_distributed,
    local_device,
)
from llmsys.profiling import training
from llmsys.profiling.config import SIZES, ModelConfig
from llmsys.profiling.infra import accounting
from llmsys.profiling.model import TransformerLM
from llmsys.profiling.rounds import (
    interleaved,
    nccl_kernel_ms,
    release,
    run_fields,
    slowest,
    timed_steps,
)


def torch_ddp(module, *, bf16: bool = False):
    device = next(module.parameters()).device
    ddp = DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None
    )
    if bf16:
        ddp.register_comm_hook(None, bf16_compress_hook)
    return ddp


STRATEGIES: dict[str, Callable | None] = {
    "no communication": None,
    "torch DDP": torch_ddp,
    "torch DDP bf16 hook": functools.partial(torch_ddp, bf16=True),
    "naive": DDPNaive,
    "flat": DDPFlat,
    "individual": DDPIndividualParameters,
    **{
        f"bucketed {size} MB": functools.partial(DDPBucketed, bucket_size_mb=size)
        for size in (1, 10, 25, 100, 1000)
    },
    **{
        f"bucketed {size} MB bf16": functools.partial(
            DDPBucketed, bucket_size_mb=size, grad_dtype=torch.bfloat16
        )
        for size in (25, 100, 1000)
    },
}
BASELINE = "torch DDP"


def train_step(model, optimizer, tokens, targets, dtype: str) -> None:
    optimizer.zero_grad(set_to_none=True)
    with training.autocast(dtype, tokens.device):
        loss = training.lm_loss(model(tokens), targets)
    loss.backward()
    if hasattr(model, "finish_gradient_synchronization"):
        model.finish_gradient_synchronization()
    optimizer.step()


def measure(
    name: str, args, config: ModelConfig, device, rank: int, world_size: int, profiled: bool = True
) -> dict:
    torch.manual_seed(0)
    model = TransformerLM(config, device=device)
    wrap = STRATEGIES[name]
    if wrap is not None and world_size > 1:
        model = wrap(model)
    optimizer = training.make_optimizer(model, "adamw-fused")
    torch.manual_seed(1 + rank)  # each rank its own slice of data
    tokens, targets = training.random_batch(config, args.batch_size, args.context_length, device)
    step = functools.partial(train_step, model, optimizer, tokens, targets, args.dtype)
    times, peak = timed_steps(step, args.warmup, args.steps, device, world_size)
    started = time.perf_counter()
    step()  # how long the host takes to issue a step: near the step time, the host is the limit
    host_ms = (time.perf_counter() - started) * 1e3
    training.synchronize(device)
    communicates = wrap is not None and world_size > 1
    comm = nccl_kernel_ms(step, device) if communicates and profiled else None
    measured = {
        "times_ms": [slowest(t, device) * 1e3 for t in times],
        "nccl_ms": comm,
        "host_ms": slowest(host_ms, device),
        "peak_gib": peak,
        "buckets": len(getattr(model, "buckets", [])) or None,
    }
    release(model, optimizer)
    del model, optimizer, step
    training.free_device_memory(device)
    return measured


def rows_for(measured: dict[str, dict], args, config, world_size, device) -> list[results.Row]:
    tokens = world_size * args.batch_size * args.context_length
    flops = accounting.step_flops(config, args.batch_size, args.context_length, "train-step")
    peak, peak_source = accounting.peak_flops(
        results.device_name(device), accounting.matmul_precision(args.dtype)
    )
    floor = statistics.median(measured["no communication"]["times_ms"])
    anchor = measured.get(BASELINE)
    anchor_ms = statistics.median(anchor["times_ms"]) if anchor else None
    rows = []
    for name, m in measured.items():
        p20, p50, p80 = results.quantiles(m["times_ms"])
        notes = [
            f"exposed communication {p50 - floor:.1f} ms",
            f"step time {p50 / floor:.2f}x no communication's",
        ]
        if m["nccl_ms"]:
            notes.append(f"NCCL kernels {m['nccl_ms']:.1f} ms/step")
        if m["buckets"]:
            notes.append(f"{m['buckets']} buckets")
        notes.append(f"host {m['host_ms']:.0f} ms/step")
        notes.append(f"MFU vs {peak_source}" if peak else "")
        rows.append(
            results.Row(
                kernel="transformer_lm/data_parallel",
                provider=name,
                mode=f"{world_size} ranks",
                x=f"{args.size} ctx{args.context_length} b{args.batch_size}/rank",
                dtype=args.dtype,
                p20=p20,
                p50=p50,
                p80=p80,
                throughput=tokens / (p50 / 1e3),
                throughput_unit="tokens/s",
                roofline_fraction=flops / (p50 / 1e3) / peak if peak else None,
                speedup_vs_baseline=anchor_ms / p50 if anchor_ms else None,
                config="; ".join(n for n in notes if n),
                **run_fields(m, device),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", default="xl", choices=list(SIZES), help="a profiling model size (default xl)"
    )
    parser.add_argument("--context-length", type=positive_int, default=512)
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument("--dtype", choices=training.DTYPES, default="bf16")
    parser.add_argument(
        "--steps", type=positive_int, default=5, help="timed steps per strategy and round"
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=3, help="untimed steps per round first"
    )
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="rounds over all strategies, interleaved (default 3)")  # fmt: skip
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=None)
    parser.add_argument("--out", type=Path, required=True, help="CSV written by rank 0")
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    device = local_device()
    config = ModelConfig.named(args.size, context_length=args.context_length, ffn="eager")
    names = args.strategies or list(STRATEGIES)
    names = ["no communication"] + [n for n in names if n != "no communication"]
    if device.type != "cuda":  # torch's hook needs NCCL; ours runs on gloo too
        names = [n for n in names if n != "torch DDP bf16 hook"]

    def report(name: str, m: dict) -> None:
        if rank == 0:
            left = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else 0
            print(f"{name:24s} {statistics.median(m['times_ms']):8.1f} ms, peak "
                  f"{m['peak_gib'] or 0:.1f} GiB, {left:.1f} GiB left", flush=True)  # fmt: skip

    def measure_one(name: str, profiled: bool) -> dict:
        return measure(name, args, config, device, rank, world_size, profiled)

    measured = interleaved(measure_one, names, args.rounds, report)
    if rank == 0:
        rows = rows_for(measured, args, config, world_size, device)
        results.write_csv(rows, args.out)
        print(results.markdown_table(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
