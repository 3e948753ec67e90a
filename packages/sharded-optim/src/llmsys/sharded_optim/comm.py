"""What this process sees of ``torch.distributed``: its rank, the world size, where collective
tensors live, and a check that every rank holds the same parameters.

Without an initialized process group a process is rank 0 of a world of 1, and nothing here
communicates.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """Where a tensor must be for the default group's collectives: this rank's current CUDA
    device under NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_size_of_group() -> int:
    return rank_and_world_size()[1]


def all_gathered(value: Any) -> list[Any]:
    """Every rank's ``value`` (small, picklable), in rank order, on every rank. Checks built on
    it give all ranks the same answer, so they raise together instead of some ranks hanging in
    the next collective."""
    _, world_size = rank_and_world_size()
    if world_size == 1:
        return [value]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def check_same_parameters(params: Sequence[torch.Tensor], where: str) -> None:
    """Raise ``ValueError`` on every rank unless all ranks pass parameters of the same shapes
    and dtypes in the same order: the ownership and the broadcasts assume it, and a mismatch would
    otherwise hang in a collective or copy the wrong bytes. Under NCCL every parameter must be
    on a GPU (its broadcasts cannot carry CPU tensors), checked here before any step."""
    if world_size_of_group() > 1 and "nccl" in str(dist.get_backend()):
        on_cpu = [i for i, p in enumerate(params) if not p.is_cuda]
        if on_cpu:
            raise ValueError(
                f"{where}: with the NCCL backend every parameter must be on a CUDA device, got "
                f"CPU parameters at global indices {on_cpu[:10]}"
            )
    layout = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    values = all_gathered(zlib.crc32(layout.encode()))
    if len(set(values)) > 1:
        raise ValueError(
            f"{where}: every rank must pass the same parameters (shapes and dtypes, in the same "
            f"order), got different ones (a checksum per rank: {values}; this rank has "
            f"{len(params)} parameters)"
        )
    # The same values too: each owner broadcasts its updated parameters over the others', which
    # only keeps them right if they were replicas. FSDP's slices share shapes but not values.
    sums = [str(v) for v in _sums(params)]
    differs = [i for i, s in enumerate(zip(*all_gathered(sums), strict=True)) if len(set(s)) > 1]
    if differs:
        i = differs[0]
        raise ValueError(
            f"{where}: every rank must pass replicas of the same parameters (equal values), got "
            f"{len(differs)} that differ between ranks, the first at global index {i} (shape "
            f"{tuple(params[i].shape)}): either each rank holds its own slice of a sharded model "
            f"(FSDP, which shards the optimizer state already: give it a plain optimizer), or the "
            f"replicas are not synchronized yet (build {where} after wrapping the model in DDP, "
            "which broadcasts rank 0's weights)"
        )


def _sums(params: Sequence[torch.Tensor]) -> list[float]:
    """Each parameter's sum in float64: equal on every rank for replicas; one sync in all."""
    if world_size_of_group() == 1 or not params:
        return []
    device = params[0].device
    return torch.stack([p.detach().sum(dtype=torch.float64).to(device) for p in params]).tolist()
