"""Training step, peak memory and tokens/s under DDP, ZeRO-1, this FSDP and torch's FSDP2: torchrun.

    torchrun --nproc-per-node 2 fsdp.py --size xl --out fsdp.csv            # each strategy
    torchrun --nproc-per-node 2 fsdp.py --size 2.7B --checkpointing on --out fsdp.csv
    torchrun --nproc-per-node 2 fsdp.py --largest 10B --out largest.csv     # a model one GPU
                                                                            # cannot train

The model is the profiling package's ``TransformerLM`` (SDPA attention, SwiGLU) on random tokens,
context 512, batch 4 per GPU, fused AdamW; ``--kernels fused`` swaps its RMSNorm (residual add
included) and RoPE for ``llmsys.kernels_fused``'s. (The fused loss stays out: it reads
``lm_head``'s weight outside ``lm_head``'s forward, which FSDP does not gather for.) Every
strategy is built afresh in one process group, one after another:

- one GPU alone: float32 weights, bf16 autocast, no communication (the floor);
- DDPBucketed, and ShardedOptimizer (AdamW state sharded) + DDPBucketed: bf16 autocast;
- FSDP (float32), FSDP bf16 (weights cast to bf16 before the all-gather);
- torch FSDP2 (``fully_shard`` per block and the root), float32 or bf16
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``);
- both bf16 FSDPs with two blocks per all-gather and reduce-scatter (``blocks_per_gather=2``;
  ``fully_shard`` on each pair of blocks).

Strategies take turns in ``--rounds`` rounds (see ``strategies.py``). Both FSDPs reduce
gradients in float32, so "bf16" compares equal settings but for the norms' gains (FSDP2 casts
them to bf16; ours keeps them in float32, its mixed-precision policy). Each row carries the
accounting model's predicted peak (``llmsys.profiling.infra.memory_model``) beside the measured one.
``--largest`` trains a model whose replicated AdamW state does not fit one GPU with FSDP bf16 and
activation checkpointing for a few steps on one fixed batch and prints the loss falling.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import non_negative_int, positive_int
from llmsys.ddp import FSDP, DDPBucketed, init_distributed, local_device
from llmsys.profiling import training
from llmsys.profiling.config import SIZES, ModelConfig
from llmsys.profiling.infra import accounting, memory_model
from llmsys.profiling.model import TransformerBlock, TransformerLM
from llmsys.profiling.rounds import (
    interleaved,
    nccl_kernel_ms,
    release,
    run_fields,
    slowest,
    timed_steps,
)

LARGEST = {  # name: (d_model, d_ff, layers, heads) of models too large to train replicated
    "10B": (4096, 16384, 36, 32),
    "20B": (6144, 24576, 26, 48),
}


def fsdp2(model, bf16: bool, blocks_per_gather: int = 1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The mesh on the model's device: fully_shard's default is CUDA whenever a GPU exists, which
    # fails for gloo ranks on a GPU host.
    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
    )
    blocks = [module for module in model.modules() if isinstance(module, TransformerBlock)]
    for first in range(0, len(blocks), blocks_per_gather):
        group = blocks[first : first + blocks_per_gather]
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def sharded_optimizer_ddp(model):
    from llmsys.sharded_optim import ShardedOptimizer

    model = DDPBucketed(model)
    return model, ShardedOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
        fused=next(model.parameters()).is_cuda,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Strategy:
    wrap: object  # model -> model, or model -> (model, optimizer); None: no communication
    autocast: bool  # bf16 autocast around forward
    memory: str  # the accounting model's strategy
    compute: str  # "bf16" or "fp32": the gathered weights' and activations' dtype


STRATEGIES = {
    "one GPU alone": Strategy(None, True, "ddp", "bf16"),
    "DDPBucketed": Strategy(DDPBucketed, True, "ddp", "bf16"),
    "ShardedOptimizer + DDPBucketed": Strategy(sharded_optimizer_ddp, True, "zero1", "bf16"),
    "FSDP": Strategy(FSDP, False, "fsdp", "fp32"),
    "FSDP bf16": Strategy(
        functools.partial(FSDP, compute_dtype=torch.bfloat16), False, "fsdp", "bf16"
    ),
    "torch FSDP2": Strategy(functools.partial(fsdp2, bf16=False), False, "fsdp", "fp32"),
    "torch FSDP2 bf16": Strategy(functools.partial(fsdp2, bf16=True), False, "fsdp", "bf16"),
    # Two blocks per all-gather and reduce-scatter: half the collectives for the host to issue.
    "FSDP bf16, 2 blocks per gather": Strategy(
        functools.partial(FSDP, compute_dtype=torch.bfloat16, blocks_per_gather=2),
        False, "fsdp", "bf16",
    ),
    "torch FSDP2 bf16, 2 blocks per gather": Strategy(
        functools.partial(fsdp2, bf16=True, blocks_per_gather=2), False, "fsdp", "bf16"
    ),
}  # fmt: skip


def model_config(
    size: str, context_length: int, kernels: str, checkpoint: bool = False
) -> ModelConfig:
    """The benchmark model: the profiling package's ``size``, eager SwiGLU, and RMSNorm and RoPE
    ``kernels`` ("eager", or "fused": llmsys.kernels_fused's)."""
    return ModelConfig.named(
        size,
        context_length=context_length,
        ffn="eager",
        checkpoint=checkpoint,
        norm=kernels,
        rope=kernels,
    )


def predicted_gib(name: str, config: ModelConfig, tokens: int, world_size: int) -> float:
    """The accounting model's bytes per GPU: float32 weights, gradients and AdamW moments
    (sharded as the strategy shards them), activations and gathered layers in the compute
    dtype."""
    strategy = STRATEGIES[name]
    devices = 1 if strategy.wrap is None else world_size
    return memory_model.training_peak(
        memory_model.from_config(config), strategy.memory, devices,
        tokens_per_device=tokens, checkpointing=config.checkpoint, compute=strategy.compute,
    ) / 2**30  # fmt: skip


def _gib_or_mib(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def train_step(model, optimizer, tokens, targets, autocast: bool) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    with training.autocast("bf16" if autocast else "fp32", tokens.device):
        loss = training.lm_loss(model(tokens), targets)
    loss.backward()
    if hasattr(model, "finish_gradient_synchronization"):
        model.finish_gradient_synchronization()
    optimizer.step()
    return loss


def build(name: str, config: ModelConfig, device, world_size: int):
    torch.manual_seed(0)
    model = TransformerLM(config, device=device)
    wrap = STRATEGIES[name].wrap
    optimizer = None
    if wrap is not None:
        model = wrap(model)
        if isinstance(model, tuple):
            model, optimizer = model
    if optimizer is None:
        optimizer = training.make_optimizer(model, "adamw-fused")
    return model, optimizer


def measure(
    name: str, args, config: ModelConfig, device, rank: int, world_size: int, profiled: bool = True
) -> dict:
    model, optimizer = build(name, config, device, world_size)
    torch.manual_seed(1 + rank)  # each rank its own slice of data
    tokens, targets = training.random_batch(config, args.batch_size, args.context_length, device)
    autocast = STRATEGIES[name].autocast
    step = functools.partial(train_step, model, optimizer, tokens, targets, autocast)
    times, peak = timed_steps(step, args.warmup, args.steps, device, world_size)
    communicates = STRATEGIES[name].wrap is not None and world_size > 1
    measured = {
        "times_ms": [slowest(t, device) * 1e3 for t in times],
        "nccl_ms": nccl_kernel_ms(step, device) if communicates and profiled else None,
        "peak_gib": slowest(peak, device) if peak is not None else None,
    }
    release(model, optimizer)
    del model, optimizer, step
    training.free_device_memory(device)
    return measured


def rows_for(measured: dict, args, config, world_size, device) -> list[results.Row]:
    tokens = args.batch_size * args.context_length
    flops = accounting.step_flops(config, args.batch_size, args.context_length, "train-step")
    peak, _ = accounting.peak_flops(results.device_name(device), "bf16")
    alone = measured.get("one GPU alone")
    alone_ms = statistics.median(alone["times_ms"]) if alone else None
    anchors = {
        "FSDP": "torch FSDP2",
        "FSDP bf16": "torch FSDP2 bf16",
        "FSDP bf16, 2 blocks per gather": "torch FSDP2 bf16, 2 blocks per gather",
    }
    alone = "one GPU alone" if device.type == "cuda" else "one process alone"
    rows = []
    for name, m in measured.items():
        p20, p50, p80 = results.quantiles(m["times_ms"])
        predicted = predicted_gib(name, config, tokens, world_size)
        notes = [f"predicted peak {_gib_or_mib(predicted)}"]
        if alone_ms:
            notes.append(f"step time {p50 / alone_ms:.2f}x {alone}'s")
        anchor = measured.get(anchors.get(name, ""))
        if anchor:
            ratio = p50 / statistics.median(anchor["times_ms"])
            notes.append(f"step time {ratio:.2f}x {anchors[name]}'s")
        if m["nccl_ms"]:
            notes.append(f"NCCL kernels {m['nccl_ms']:.1f} ms/step")
        rows.append(
            results.Row(
                kernel="transformer_lm/sharded_training",
                provider=alone if name == "one GPU alone" else name,
                mode=f"{world_size} ranks"
                + (", checkpointing" if config.checkpoint else "")
                + (", fused norm+rope" if config.norm == "fused" else ""),
                x=f"{args.size} ctx{args.context_length} b{args.batch_size}/rank",
                dtype=STRATEGIES[name].compute,
                p20=p20,
                p50=p50,
                p80=p80,
                throughput=world_size * tokens / (p50 / 1e3),
                throughput_unit="tokens/s",
                roofline_fraction=flops / (p50 / 1e3) / peak if peak else None,
                speedup_vs_baseline=alone_ms / p50 if alone_ms else None,
                config="; ".join(notes),
                **run_fields(m, device),
            )
        )
    return rows


def train_largest(args, device, rank: int, world_size: int) -> list[results.Row]:
    """A model whose replicated training state exceeds one GPU, FSDP bf16 + checkpointing."""
    d_model, d_ff, layers, heads = LARGEST[args.largest]
    config = ModelConfig(
        d_model=d_model, d_ff=d_ff, num_layers=layers, num_heads=heads,
        context_length=args.context_length, vocab_size=10000, checkpoint=True,
        norm=args.kernels, rope=args.kernels,
    )  # fmt: skip
    shape = memory_model.from_config(config)
    replicated = memory_model.training_memory(shape, memory_model.FP32_ADAMW).state / 2**30
    model = FSDP(TransformerLM(config, device=device), compute_dtype=torch.bfloat16)
    optimizer = training.make_optimizer(model, "adamw-fused", lr=1e-3)
    torch.manual_seed(1 + rank)
    tokens, targets = training.random_batch(config, args.batch_size, args.context_length, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for step in range(args.steps):
        training.synchronize(device)
        started = time.perf_counter()
        loss = train_step(model, optimizer, tokens, targets, autocast=False)
        losses.append(loss.item())
        times.append((time.perf_counter() - started) * 1e3)
        if rank == 0:
            print(
                f"{args.largest} step {step} loss {losses[-1]:.4f} {times[-1]:.0f} ms", flush=True
            )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    predicted = predicted_gib_for(config, args, world_size)
    gpu_gib = (
        torch.cuda.get_device_properties(device).total_memory / 2**30
        if device.type == "cuda"
        else None
    )
    p20, p50, p80 = results.quantiles(times[1:] or times)
    note = (
        f"{shape.num_params / 1e9:.1f}B parameters; replicated fp32 AdamW state "
        f"{replicated:.0f} GiB vs {gpu_gib or 0:.0f} GiB per GPU; predicted peak "
        f"{predicted:.1f} GiB; loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps"
    )
    return [
        results.Row(
            kernel="transformer_lm/largest_fsdp",
            provider="FSDP bf16",
            mode=f"{world_size} ranks, checkpointing",
            x=f"{args.largest} ctx{args.context_length} b{args.batch_size}/rank",
            dtype="bf16", p20=p20, p50=p50, p80=p80,
            throughput=world_size * args.batch_size * args.context_length / (p50 / 1e3),
            throughput_unit="tokens/s", roofline_fraction=None, speedup_vs_baseline=None,
            config=note, gpu=results.device_name(device), version=torch.__version__,
            timestamp=results.timestamp(), mean=statistics.fmean(times),
            std=statistics.pstdev(times), memory_gib=peak,
        )
    ]  # fmt: skip


def predicted_gib_for(config, args, world_size: int) -> float:
    return memory_model.training_peak(
        memory_model.from_config(config), "fsdp", world_size,
        tokens_per_device=args.batch_size * args.context_length, checkpointing=True,
    ) / 2**30  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", default="xl", choices=list(SIZES), help="a profiling model size (default xl)"
    )
    parser.add_argument("--context-length", type=positive_int, default=512)
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=4,
        help="timed steps per strategy and round (default 4)",
    )
    parser.add_argument(
        "--warmup", type=non_negative_int, default=2, help="untimed steps per round first"
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="rounds over all strategies, interleaved (default 2)",
    )
    parser.add_argument("--checkpointing", choices=("off", "on", "both"), default="off",
                        help="per-block activation checkpointing")  # fmt: skip
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=None)
    parser.add_argument("--kernels", choices=("eager", "fused"), default="eager",
                        help="RMSNorm and RoPE: eager, or llmsys.kernels_fused")  # fmt: skip
    parser.add_argument("--largest", choices=list(LARGEST), default=None,
                        help="train this model with FSDP bf16 + checkpointing instead")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="CSV written by rank 0")
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    device = local_device()
    if args.largest:
        rows = train_largest(args, device, rank, world_size)
    else:
        rows = []
        for checkpoint in {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]:
            config = model_config(args.size, args.context_length, args.kernels, checkpoint)

            def measure_one(name: str, profiled: bool, config=config) -> dict:
                return training.unless_out_of_memory(
                    functools.partial(
                        measure, name, args, config, device, rank, world_size, profiled
                    ),
                    device,
                ) or {"times_ms": [float("nan")], "nccl_ms": None, "peak_gib": None}

            def report(name: str, m: dict, checkpoint=checkpoint) -> None:
                if rank == 0:
                    p50 = statistics.median(m["times_ms"])
                    print(f"{name:32s} checkpointing={checkpoint} {p50:8.1f} ms "
                          f"peak {m['peak_gib'] or 0:.1f} GiB", flush=True)  # fmt: skip

            names = args.strategies or list(STRATEGIES)
            measured = interleaved(measure_one, names, args.rounds, report)
            rows += rows_for(measured, args, config, world_size, device)
    if rank == 0:
        results.write_csv(rows, args.out)
        print(results.markdown_table(rows))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
