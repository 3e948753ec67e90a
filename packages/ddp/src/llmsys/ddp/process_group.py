"""Joining the process group that ``torchrun`` describes, and who we are in it.

``torchrun --nproc-per-node N train.py`` (one host) or ``torchrun --nnodes M --nproc-per-node N
--rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py`` (several) starts one process per GPU with
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment. The same script
started as plain ``python train.py`` has none of them and runs as the only rank.
"""

from __future__ import annotations

import atexit
import gc
import os

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group described by the environment; returns ``(rank, world_size)``.

    Args:
        backend: "nccl" or "gloo"; default NCCL where this host has a GPU for every local rank,
            else gloo. With NCCL the process's CUDA device becomes ``cuda:LOCAL_RANK`` (one GPU
            per process).

    A process that joins also collects Python's reference cycles at exit, while the interpreter
    is still whole: on torch 2.13 with gloo, a cycle left to the interpreter's teardown aborted
    about one exit in five after training ("terminate called without an active exception"),
    with or without ``destroy_process_group``.

    Without torchrun's variables (a plain ``python`` run) nothing is joined and the result is
    ``(0, 1)``: the data-parallel wrappers then train as one process with no communication. A
    process group that already exists is kept.

    Raises:
        ValueError: ``backend`` is not one of the above, is "nccl" on a host without CUDA, or
            differs from the backend of the process group that already exists; or torchrun's
            RANK / WORLD_SIZE are not integers with 0 <= RANK < WORLD_SIZE. Checked before
            anything is joined, also in a plain run.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"init_distributed: `backend` must be None or one of {BACKENDS}, got {backend!r}"
        )
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("init_distributed: `backend` 'nccl' needs CUDA, and this host has none")
    if dist.is_initialized():
        if backend is not None and dist.get_backend() != backend:
            raise ValueError(
                f"init_distributed: `backend` is {backend!r}, but the process group that "
                f"already exists uses {dist.get_backend()!r}"
            )
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    _check_rank_environment()
    if backend is None:
        # Launchers that do not set LOCAL_WORLD_SIZE: assume every rank could be on this host.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks
        backend = "nccl" if enough_gpus else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    atexit.register(gc.collect)
    return dist.get_rank(), dist.get_world_size()


def local_device() -> torch.device:
    """Where this rank's model lives: its GPU under NCCL (or a plain run on a GPU host), else
    the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    if nccl or (not dist.is_initialized() and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_rank_environment() -> None:
    values = {}
    for name in ("RANK", "WORLD_SIZE"):
        try:
            values[name] = int(os.environ[name])
        except ValueError:
            raise ValueError(
                f"init_distributed: the environment variable {name} must be an integer, got "
                f"{os.environ[name]!r}"
            ) from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ValueError(
            "init_distributed: the environment must have 0 <= RANK < WORLD_SIZE, got "
            f"RANK={values['RANK']} and WORLD_SIZE={values['WORLD_SIZE']}"
        )


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the whole world) and the group's size;
    ``(0, 1)`` when no process group was initialized and ``group`` is None.

    Raises:
        TypeError: ``group`` is neither None nor a ``torch.distributed.ProcessGroup``.
        ValueError: a ``group`` is given but torch.distributed is not initialized, or this
            process is not a member of ``group``.
    """
    # What dist.new_group returns on a rank it leaves out: a sentinel, not a group.
    if group is not None and group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
        raise ValueError(
            f"`process_group` must contain this process (global rank {dist.get_rank()}), got "
            "the sentinel dist.new_group returns on a rank it leaves out"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "`process_group` must be None or a torch.distributed.ProcessGroup, got "
            f"{type(group).__name__}"
        )
    if not dist.is_initialized():
        if group is not None:
            raise ValueError(
                "`process_group` was given but torch.distributed is not initialized; call "
                "init_distributed() (or dist.init_process_group) first, or pass None"
            )
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "`process_group` must contain this process (global rank "
            f"{dist.get_rank()}), but it is not a member"
        )
    return rank, dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (collectives name their source globally)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
