"""After each step, make every rank's parameters equal again: each owner broadcasts what it
updated, in buckets.

Only a parameter's owner ran the optimizer on it, so after ``step`` the other ranks hold its old
value. The schedule, the same on every rank:

    for owner in 0..N-1:
        for bucket in owner's buckets:          # same device and dtype within a bucket
            broadcast(bucket, src=owner)         # in place, or through one flat buffer

A bucket is either one contiguous parameter, broadcast in its own storage (no copy), or several
parameters packed into one flat buffer by the owner and unpacked by the others. Parameters are
packed until the buffer would pass :data:`BUCKET_BYTES`.

Why broadcasts from owners, and why buckets: each rank needs exactly the other ranks' updated
parameters, and a broadcast from the owner sends each byte once, into the receivers' own
parameter storage, with no padding and no second copy of the model. torch's
``ZeroRedundancyOptimizer`` broadcasts the same bytes one parameter at a time; a model with many
small tensors (norm weights, biases) then pays a collective launch for each. Packing the small
ones leaves about one collective per owner per 32 MiB of them, while the large ones skip the
pack and unpack copies; the receivers' only extra memory is one buffer of at most 32 MiB.
The alternative, an all-gather of padded flat shards, needs a flat buffer as large as all
parameters (Ψ elements) on every rank, or the parameters themselves turned into views of one,
and padding, since whole-tensor shards are not equal in size.
Communication volume is the same either way: each rank receives the parameters it does not
own, (N-1)/N of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

# Largest flat buffer a bucket packs. Small enough to bound the receivers' temporary memory
# (one buffer at a time); large enough that few collectives are launched, while packing stays
# cheap (two memory passes over the small tensors, where a collective costs tens of
# microseconds to launch whatever its size).
BUCKET_BYTES = 32 * 2**20


@dataclasses.dataclass(frozen=True, eq=False)
class Bucket:
    """Parameters that one rank, ``owner``, broadcasts in one collective.

    Attributes:
        owner: the rank that updated them and sends them.
        params: the parameters, all on one device with one dtype, in global index order.
    """

    owner: int
    params: tuple[torch.Tensor, ...]

    @property
    def in_place(self) -> bool:
        """One contiguous parameter: broadcast in its own storage, no flat buffer."""
        return len(self.params) == 1 and self.params[0].is_contiguous()

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def make_buckets(
    params: Sequence[torch.Tensor], owners: Sequence[int], bucket_bytes: int | None = None
) -> list[Bucket]:
    """The broadcast buckets of an ownership, owner 0's first, in the order every rank sends them.

    Args:
        params: every parameter, in global index order.
        owners: ``owners[i]`` is the rank that owns ``params[i]`` (``Ownership.owners``).
        bucket_bytes: a contiguous parameter of at least this many bytes goes alone, in place;
            smaller ones are packed while the buffer stays within it. Default (None): the
            module's :data:`BUCKET_BYTES` at the time of the call, 32 MiB.

    Returns:
        The buckets. A pure function of the parameters' owners, devices, dtypes, sizes and
        contiguity, so every rank makes the same list.
    """
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    buckets: list[Bucket] = []
    for owner in sorted(set(owners)):
        packing: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        packed_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
        for param, param_owner in zip(params, owners, strict=True):
            if param_owner != owner:
                continue
            nbytes = param.numel() * param.element_size()
            if param.is_contiguous() and nbytes >= bucket_bytes:
                buckets.append(Bucket(owner, (param,)))
                continue
            key = (param.device, param.dtype)
            if key in packing and packed_bytes[key] + nbytes > bucket_bytes:  # full: send it
                buckets.append(Bucket(owner, tuple(packing.pop(key))))
                del packed_bytes[key]
            packing.setdefault(key, []).append(param)
            packed_bytes[key] = packed_bytes.get(key, 0) + nbytes
        buckets += [Bucket(owner, tuple(packed)) for packed in packing.values()]
    return buckets


@torch.no_grad()
def broadcast_from_owners(buckets: Sequence[Bucket], rank: int) -> None:
    """Overwrite every parameter with its owner's value (call on every rank, same ``buckets``).

    Args:
        buckets: from :func:`make_buckets`, identical on every rank.
        rank: this process's rank in the default process group.
    """
    for bucket in buckets:
        if bucket.in_place:
            dist.broadcast(bucket.params[0], src=bucket.owner)
            continue
        first = bucket.params[0]
        if rank == bucket.owner:
            flat = torch.cat([p.reshape(-1) for p in bucket.params])  # (numel,)
        else:
            flat = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
        dist.broadcast(flat, src=bucket.owner)
        if rank != bucket.owner:
            pieces = flat.split([p.numel() for p in bucket.params])
            for param, piece in zip(bucket.params, pieces, strict=True):
                param.copy_(piece.view_as(param))
