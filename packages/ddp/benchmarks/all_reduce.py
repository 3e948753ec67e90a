"""All-reduce latency and bandwidth, one process per rank: run it with torchrun.

    torchrun --nproc-per-node 2 all_reduce.py --out ar.csv            # NCCL on GPUs, else gloo
    torchrun --nproc-per-node 6 all_reduce.py --backend gloo --out ar.csv

For each float32 tensor size, ``--rounds`` rounds of ``--calls`` back-to-back all-reduces, timed
from a barrier to the moment the slowest rank is done (CUDA events on GPUs), per call. Algorithm
bandwidth is bytes / time; bus bandwidth multiplies it by 2(n-1)/n, the fraction of the data a
ring all-reduce moves over each link, so it compares across rank counts (nccl-tests' convention).
Rank 0 writes the rows (the shared results schema) to ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llmsys.bench_harness import results
from llmsys.bench_harness.arguments import positive_float, positive_int
from llmsys.ddp import init_distributed, local_device
from llmsys.profiling.infra import roofline_check

MB = 10**6  # sizes are decimal megabytes, as nccl-tests and the issue state them


def time_all_reduce(tensor: torch.Tensor, calls: int, rounds: int) -> list[float]:
    """Seconds per all-reduce, one value per round, as the slowest rank saw it."""
    on_cuda = tensor.is_cuda
    for _ in range(2):  # warm-up: connections, NCCL channels, allocator
        dist.all_reduce(tensor)
    per_call = []
    for _ in range(rounds):
        dist.barrier()
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                dist.all_reduce(tensor)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            started = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(tensor)
            seconds = time.perf_counter() - started
        slowest = torch.tensor([seconds], dtype=torch.float64, device=tensor.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        per_call.append(slowest.item() / calls)
    return per_call


def rows_for(size_mb: float, per_call: list[float], world_size: int, backend: str, device):
    nbytes = int(size_mb * MB)
    p20, p50, p80 = results.quantiles(per_call)
    algbw = nbytes / p50 / 1e9
    busbw = algbw * 2 * (world_size - 1) / world_size
    return results.Row(
        kernel="all_reduce",
        provider=backend,
        mode=f"{world_size} ranks",
        x=f"{size_mb:g} MB",
        dtype="fp32",
        p20=p20 * 1e3,
        p50=p50 * 1e3,
        p80=p80 * 1e3,
        throughput=busbw,
        throughput_unit="GB/s busbw",
        config=f"algbw={algbw:.4g} GB/s; busbw=algbw*2(n-1)/n; {len(per_call)} rounds",
        gpu=results.device_name(device),
        version=torch.__version__,
        timestamp=results.timestamp(),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=positive_float, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on GPUs")
    parser.add_argument("--rounds", type=positive_int, default=10, help="timed rounds per size")
    parser.add_argument("--out", type=Path, required=True, help="CSV written by rank 0")
    args = parser.parse_args(argv)
    rank, world_size = init_distributed(args.backend)
    backend = dist.get_backend() if dist.is_initialized() else "none"
    device = local_device()
    rows = []
    for size_mb in args.sizes_mb:
        tensor = torch.zeros(int(size_mb * MB) // 4, device=device)  # sums stay finite
        # Enough calls per round that launch jitter is small against the round, few for 1 GB.
        calls = max(1, min(50, int(200 / size_mb)))
        per_call = time_all_reduce(tensor, calls, args.rounds)
        tensor.fill_(rank + 1)
        dist.all_reduce(tensor)
        if tensor.min() != tensor.max() or tensor[0] != world_size * (world_size + 1) / 2:
            raise RuntimeError(f"all_reduce of {size_mb} MB returned a wrong sum")
        rows.append(rows_for(size_mb, per_call, world_size, backend, device))
        predicted = roofline_check.predict(rows[-1])  # the alpha-beta model's ring all-reduce
        if predicted:
            rows[-1].config += f"; roofline {predicted[0]:.4g} ms ({predicted[1]})"
        if rank == 0:
            guess = f", predicted {predicted[0]:.3f} ms" if predicted else ""
            print(f"{backend} {world_size} ranks {size_mb:g} MB: {rows[-1].p50:.3f} ms, "
                  f"{rows[-1].throughput:.1f} GB/s busbw{guess}", flush=True)  # fmt: skip
        del tensor
    if rank == 0:
        results.write_csv(rows, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
