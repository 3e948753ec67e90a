"""Host time of one training step, alone and under FSDP, and a cProfile of it: use torchrun.

    torchrun --nproc-per-node 2 host_profile.py --kernels fused --out DIR

For each strategy (names of ``fsdp.py``; default "one GPU alone" and "FSDP bf16"), on the model
and batch ``fsdp.py`` uses: the median over ``--steps`` steps of the host time to issue a step
(no synchronize inside it) and of the whole step (synchronized), then one step under
``cProfile`` on rank 0, written to ``DIR/cprofile-<strategy>.txt`` (by own time, then by
cumulative time). A step whose host time is close to its wall time is host-bound, and the
profile says which Python calls the host spends it in. cProfile only sees the thread that starts
the step; autograd's backward runs on the same one when it calls Python hooks.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import llmsys.bench_harness as harness
from llmsys.bench_harness.arguments import positive_int
from llmsys.ddp import init_distributed, local_device
from llmsys.profiling import training
from llmsys.profiling.config import SIZES

_fsdp = harness.load_beside(__file__, "fsdp")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", default="xl", choices=list(SIZES), help="a profiling model size (default xl)"
    )
    parser.add_argument("--context-length", type=positive_int, default=512)
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank")
    parser.add_argument("--kernels", choices=("eager", "fused"), default="eager",
                        help="RMSNorm and RoPE: eager, or llmsys.kernels_fused")  # fmt: skip
    parser.add_argument("--strategies", nargs="+", choices=list(_fsdp.STRATEGIES),
                        default=["one GPU alone", "FSDP bf16"])  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps (default 5)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the profiles")
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    device = local_device()
    config = _fsdp.model_config(args.size, args.context_length, args.kernels)
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = torch.randint(
        0, config.vocab_size, (args.batch_size, args.context_length), device=device
    )
    for name in args.strategies:
        model, optimizer = _fsdp.build(name, config, device, world_size)
        autocast = _fsdp.STRATEGIES[name].autocast

        def step(model=model, optimizer=optimizer, autocast=autocast) -> None:
            _fsdp.train_step(model, optimizer, tokens, tokens, autocast)

        for _ in range(3):
            step()
        hosts, walls = [], []
        for _ in range(args.steps):
            if world_size > 1:
                dist.barrier()
            training.synchronize(device)
            started = time.perf_counter()
            step()
            issued = time.perf_counter()
            training.synchronize(device)
            hosts.append((issued - started) * 1e3)
            walls.append((time.perf_counter() - started) * 1e3)
        profiler = cProfile.Profile()
        profiler.enable()
        step()
        profiler.disable()
        if rank == 0:
            host, wall = statistics.median(hosts), statistics.median(walls)
            print(f"{name}: host {host:.1f} ms to issue a step, {wall:.1f} ms a step", flush=True)
            text = io.StringIO()
            print(f"{name}, {args.size} ctx{args.context_length} b{args.batch_size}/rank, "
                  f"kernels {args.kernels}, {world_size} ranks: host {host:.1f} ms, step "
                  f"{wall:.1f} ms (medians of {args.steps})\n", file=text)  # fmt: skip
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumtime").print_stats(45)
            (args.out / f"cprofile-{name.replace(' ', '-')}.txt").write_text(text.getvalue())
        _fsdp.release(model, optimizer)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
