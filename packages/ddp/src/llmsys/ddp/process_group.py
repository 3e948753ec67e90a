"""Joining the process group that ``torchrun`` describes, and who we are in it.

``torchrun --nproc-per-node N train.py`` (one host) or ``torchrun --nnodes M --nproc-per-node N
--rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py`` (several) starts one process per GPU with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment. The same script
started as plain ``python train.py`` has none of them and runs as the only rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group described by the environment; returns ``(rank, world_size)``.

    Args:
        backend: "nccl" or "gloo"; default NCCL where this host has a GPU for every local rank,
            else gloo. With NCCL the process's CUDA device becomes ``cuda:LOCAL_RANK`` (one GPU
            per process).

    Without torchrun's variables (a plain ``python`` run) nothing is joined and the result is
    ``(0, 1)``: the data-parallel wrappers then train as one process with no communication. A
    process group that already exists is kept.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    if backend is None:
        # Launchers that do not set LOCAL_WORLD_SIZE: assume every rank could be on this host.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
        backend = "nccl" if enough_gpus else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def local_device() -> torch.device:
    """Where this rank's model lives: its GPU under NCCL (or a plain run on a GPU host), else
    the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    if nccl or (not dist.is_initialized() and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the whole world) and the group's size;
    ``(0, 1)`` when no process group was initialized."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives name their source globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
