"""FSDP's mechanics: a weight cut into per-rank slices, and the collectives that move slices.

A sharded weight is flattened, padded with zeros to a multiple of N ranks and cut in N equal
pieces; rank r keeps piece r (``Shard``). Two collectives turn slices into full tensors and back,
each for several weights at once (a block's), because the host pays a fixed time per collective:

    Gather          every rank's slices of several weights -> each full weight (all-gather)
    ReduceScatter   full gradients of several weights -> this rank's slice of each, summed
                    over ranks (reduce-scatter)

Both lay several weights out the same way: rank r's part of the flat buffer holds its slices of
every weight one after another, so viewed as (ranks, total) the columns of one weight, read row
by row, are its padded flat form. Nothing here decides when a collective runs: ``fsdp.py`` (the
schedule) does.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

# torch 2.13 renamed the single-tensor collectives and warns on the old names, which are all that
# older torch has.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def is_sharded(param: torch.Tensor) -> bool:
    """The sharding rule: a 2-D parameter (a matmul's or a lookup's weight) is sharded."""
    return param.dim() == 2


class Shard:
    """One sharded parameter: its full shape and how its flat, padded form splits over ranks."""

    def __init__(self, param: nn.Parameter, name: str, rank: int, world_size: int):
        self.param, self.name = param, name
        self.shape = param.shape
        self.numel = param.numel()
        self.size = math.ceil(self.numel / world_size)  # elements per rank
        self.padded = self.size * world_size
        self.rank, self.world_size = rank, world_size

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size tensor (a fresh tensor, zero-padded at the end)."""
        flat = full.detach().reshape(-1)
        start = self.rank * self.size
        piece = flat[start : min(start + self.size, self.numel)]
        out = torch.zeros(self.size, dtype=full.dtype, device=full.device)
        out[: piece.numel()] = piece
        return out

    def gather_full(self, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The full weight from every rank's slice, in the parameter's dtype (a copy; blocks
        until every rank has sent its slice)."""
        source = self.param.detach()
        out = torch.empty(self.padded, dtype=source.dtype, device=source.device)
        if self.world_size == 1:
            out.copy_(source)
        else:
            _all_gather_single(out, source, group=group)
        return out[: self.numel].view(self.shape)


class Gather:
    """One all-gather of several weights' slices, cast to ``dtype``, started at construction;
    ``wait()`` splits the gathered buffer into the full weights (one split-copy for all)."""

    def __init__(
        self,
        shards: list[Shard],
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        world_size: int,
    ):
        self.shards = shards
        self.world_size = world_size
        self.sizes = [shard.size for shard in shards]
        device = shards[0].param.device
        send = torch.empty(sum(self.sizes), dtype=dtype, device=device)
        torch._foreach_copy_(list(send.split(self.sizes)), [s.param.detach() for s in shards])
        self.gathered: torch.Tensor | None = torch.empty(
            world_size * send.numel(), dtype=dtype, device=device
        )
        self.work: dist.Work | None = None
        if world_size == 1:
            self.gathered.copy_(send)
        else:
            self.work = _all_gather_single(self.gathered, send, group=group, async_op=True)

    def wait(self) -> list[torch.Tensor]:
        """The full weights, in ``shards``' order (call once: the buffer is let go)."""
        if self.work is not None:
            self.work.wait()  # on a GPU the stream waits, not the host
        assert self.gathered is not None  # (wait runs once)
        rows = self.gathered.view(self.world_size, -1)
        padded = [rows.new_empty(self.world_size, size) for size in self.sizes]
        torch.split_with_sizes_copy(rows, self.sizes, dim=1, out=padded)
        self.gathered, self.work = None, None
        return [
            flat.view(-1)[: shard.numel].view(shard.shape)
            for shard, flat in zip(self.shards, padded, strict=True)
        ]


class ReduceScatter:
    """One reduce-scatter of full gradients of parameters of one dtype, started at
    construction; ``wait()`` gives this rank's slice of each, summed over ranks.

    The gradients are copied (and cast to the parameters' dtype: the sum is taken in it)
    straight into their columns of the send buffer: one concatenation for all of them."""

    def __init__(
        self,
        pending: list[tuple[Shard, torch.Tensor]],
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
    ):
        self.shards = [shard for shard, _ in pending]
        sizes = [shard.size for shard in self.shards]
        first = self.shards[0].param
        send = torch.empty(world_size, sum(sizes), dtype=first.dtype, device=first.device)
        columns = []
        for shard, grad in pending:
            if shard.numel != shard.padded:  # the last rank's slice ends in zeros
                grad = torch.cat([grad.reshape(-1), grad.new_zeros(shard.padded - shard.numel)])
            columns.append(grad.reshape(world_size, shard.size))
        torch.cat(columns, dim=1, out=send)
        received = send.new_empty(sum(sizes))
        self.work, self.send = None, None
        if world_size == 1:
            received.copy_(send.view(-1))
        else:
            self.send = send  # read by the collective until it is done
            try:
                self.work = _reduce_scatter_single(
                    received, send.view(-1), group=group, async_op=True
                )
            except (RuntimeError, NotImplementedError):
                if dist.get_backend(group) == "nccl":
                    raise
                # gloo before torch 2.8 has no reduce-scatter: all-reduce and keep this rank's row
                self.work = dist.all_reduce(send, group=group, async_op=True)
                received = send[rank]
        self.pieces = received.split(sizes)

    def wait(self) -> list[tuple[Shard, torch.Tensor]]:
        """(shard, this rank's slice of its summed gradient) for each gradient sent."""
        if self.work is not None:
            self.work.wait()
        self.work, self.send = None, None
        return list(zip(self.shards, self.pieces, strict=True))
