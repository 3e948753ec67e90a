"""Four ways to average gradients over ranks, from the simplest to the one torch DDP uses.

All four keep the contract of :class:`~llmsys.ddp.base.DataParallelBase`; they differ in how many
collectives they issue and when:

| wrapper                    | collectives per step          | starts communicating      |
|----------------------------|-------------------------------|---------------------------|
| ``DDPNaive``               | one per parameter             | after backward            |
| ``DDPFlat``                | one (per dtype)               | after backward            |
| ``DDPIndividualParameters``| one per parameter             | as each gradient is ready |
| ``DDPBucketed``            | one per bucket of ~25 MiB     | as each bucket is ready   |

Each collective has a fixed cost (launch, synchronization between ranks) on top of its bytes, so
few large collectives beat many small ones; and communication started during backward hides
behind the rest of backward. Bucketing gets both (``docs/overlap.md`` models the trade-off).

Collectives are matched across ranks by the order they are issued in, so the overlapping
wrappers launch buckets strictly in bucket order: a bucket whose gradients are complete waits for
the buckets before it. Autograd's order can differ between ranks; the bucket order cannot.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallelBase
from .buckets import group_buckets


def _divide(tensors: list[torch.Tensor], divisor: int) -> None:
    """Sums over ranks become means, one kernel launch for the whole list."""
    if tensors:
        torch._foreach_div_(tensors, divisor)


class DDPNaive(DataParallelBase):
    """One blocking all-reduce per parameter, after backward. The baseline: simple and slow.

    Args:
        module: the model (reachable as ``.module``).
        process_group: the ranks to average over (default: all).

    Raises:
        TypeError, ValueError: as :class:`~llmsys.ddp.base.DataParallelBase`.
    """

    def _synchronize(self) -> None:
        local = self.local_gradients()
        for grad in local:
            dist.all_reduce(grad, group=self.process_group)
        used = self.used_everywhere()
        _divide([g for g, is_used in zip(local, used, strict=True) if is_used], self.world_size)


class DDPFlat(DataParallelBase):
    """Every gradient copied into one flat buffer per dtype, one all-reduce, copied back.

    Args:
        module: the model (reachable as ``.module``).
        process_group: the ranks to average over (default: all).

    Raises:
        TypeError, ValueError: as :class:`~llmsys.ddp.base.DataParallelBase`.
    """

    def _synchronize(self) -> None:
        all_reduce_flat(
            self.local_gradients(), self.used_everywhere, self.process_group, self.world_size
        )


def all_reduce_flat(
    gradients: list[torch.Tensor],
    used_everywhere: Callable[[], list[bool]],
    group: dist.ProcessGroup | None,
    world_size: int,
) -> None:
    """Average ``gradients`` over the ranks of ``group`` with one all-reduce per dtype
    (DDPFlat's way), in place. ``used_everywhere()`` (a wrapper's) says which gradients any rank
    had; the others are reduced too, so every rank issues the same collectives, but left as they
    were. It is asked once the all-reduces are issued: where it raises (ranks disagree), this
    rank has issued the collectives the others wait for."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, grad in enumerate(gradients):
        by_dtype.setdefault(grad.dtype, []).append(index)
    flats = {}
    for dtype, indices in by_dtype.items():
        flats[dtype] = torch.cat([gradients[i].reshape(-1) for i in indices])
        dist.all_reduce(flats[dtype], group=group)
    used = used_everywhere()
    for dtype, indices in by_dtype.items():
        flat = flats[dtype].div_(world_size)
        pieces = flat.split([gradients[i].numel() for i in indices])
        for i, piece in zip(indices, pieces, strict=True):
            if used[i]:
                gradients[i].copy_(piece.view_as(gradients[i]))


class _Bucket:
    """Parameters whose gradients travel in one all-reduce.

    A bucket of one parameter whose gradient already has the wire dtype reduces ``.grad`` in
    place; any other bucket copies its gradients into a flat buffer of the wire dtype first.
    """

    def __init__(self, indices: list[int], params: list[nn.Parameter], wire_dtype: torch.dtype):
        self.indices = indices
        self.wire_dtype = wire_dtype
        self.in_place = len(indices) == 1 and params[indices[0]].dtype == wire_dtype
        self.numels = [params[i].numel() for i in indices]
        self.buffer: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None  # the tensor the all-reduce works on
        self.waiting = len(indices)  # gradients still to arrive in this backward
        self.work: dist.Work | None = None

    def views(self) -> list[torch.Tensor]:
        assert self.buffer is not None  # (allocated by the bucket's first launch)
        return list(self.buffer.split(self.numels))


class _OverlappedDataParallel(DataParallelBase):
    """Buckets launched from the gradient hooks, in bucket order; the rest at the end."""

    def __init__(
        self,
        module: nn.Module,
        buckets_of: Callable[[list[nn.Parameter]], tuple[list[list[int]], list[torch.dtype]]],
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, process_group=process_group)
        indices_of, wire_dtypes = buckets_of(self.params)
        self.buckets = [_Bucket(ix, self.params, wire_dtypes[ix[0]]) for ix in indices_of]
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        self._next = 0  # the next bucket to launch

    def _gradient_ready(self, index: int) -> None:
        bucket = self.buckets[self._bucket_of[index]]
        bucket.waiting -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        # None where a parameter got no gradient since the last synchronization (an old .grad
        # left from before must not be reduced).
        grads = [self.params[i].grad if self._used[i] else None for i in bucket.indices]
        if bucket.in_place:
            # No gradient here: zeros keep the ranks' collectives matched.
            param = self.params[bucket.indices[0]]
            reduced = grads[0] if grads[0] is not None else torch.zeros_like(param)
        else:
            device = self.params[bucket.indices[0]].device
            if bucket.buffer is None or bucket.buffer.device != device:
                bucket.buffer = torch.empty(
                    sum(bucket.numels), dtype=bucket.wire_dtype, device=device
                )
            targets, sources = [], []
            for grad, view in zip(grads, bucket.views(), strict=True):
                if grad is None:
                    view.zero_()  # no gradient here (unused in this step)
                else:
                    targets.append(view)
                    sources.append(grad.reshape(-1))
            if targets:  # one multi-tensor launch instead of one copy per parameter
                torch._foreach_copy_(targets, sources)
            reduced = bucket.buffer
        bucket.reduced = reduced
        bucket.work = dist.all_reduce(reduced, group=self.process_group, async_op=True)

    def _synchronize(self) -> None:
        # Buckets still incomplete (a parameter unused in this backward, or used only in an
        # earlier no_sync micro-batch) go now, in bucket order like the others.
        for bucket in self.buckets[self._next :]:
            self._launch(bucket)
        self._next = len(self.buckets)
        used = self.used_everywhere()
        in_place: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        sums: list[torch.Tensor] = []
        for bucket in self.buckets:
            assert bucket.work is not None  # every bucket was launched above
            bucket.work.wait()
            if bucket.in_place:
                if used[bucket.indices[0]]:
                    assert bucket.reduced is not None  # (set by the launch)
                    in_place.append(bucket.reduced)
                continue
            for i, view in zip(bucket.indices, bucket.views(), strict=True):
                if used[i]:
                    grad = self.params[i].grad
                    assert grad is not None  # (used here: ranks that disagree raised)
                    grads.append(grad)
                    sums.append(view.view_as(grad))
        if grads:
            torch._foreach_copy_(grads, sums)  # back in the gradients' dtype, then divided there
        _divide(in_place + grads, self.world_size)

    def _reset(self) -> None:
        super()._reset()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()  # a step that raised may leave collectives in flight
            bucket.work = bucket.reduced = None
            bucket.waiting = len(bucket.indices)
        self._next = 0


class DDPIndividualParameters(_OverlappedDataParallel):
    """An asynchronous all-reduce per parameter, launched by the hook that sees its gradient
    complete, so communication overlaps the rest of backward.

    Launches follow reverse registration order (the order backward usually produces gradients);
    a gradient that arrives early waits for the parameters before it in that order.

    Args:
        module: the model (reachable as ``.module``).
        process_group: the ranks to average over (default: all).

    Raises:
        TypeError, ValueError: as :class:`~llmsys.ddp.base.DataParallelBase`.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None):
        def one_per_parameter(
            params: list[nn.Parameter],
        ) -> tuple[list[list[int]], list[torch.dtype]]:
            return [[i] for i in reversed(range(len(params)))], [p.dtype for p in params]

        super().__init__(module, one_per_parameter, process_group=process_group)


class DDPBucketed(_OverlappedDataParallel):
    """Gradients grouped into buckets of at most ``bucket_size_mb`` MiB, in reverse registration
    order; one asynchronous all-reduce per bucket, launched when its last gradient arrives.

    Args:
        module: the model (reachable as ``.module``).
        bucket_size_mb: the cap per bucket in MiB of gradient bytes on the wire (default 25.0,
            torch DDP's default); a parameter larger than the cap gets its own bucket.
        grad_dtype: the dtype gradients are reduced in (default: their own). ``torch.bfloat16``
            halves the bytes on the wire of float32 gradients: they are rounded to bfloat16,
            summed in bfloat16 and the mean is written back in float32, as torch DDP's
            ``bf16_compress_hook`` does.
        process_group: the ranks to average over (default: all).

    Raises:
        TypeError: ``bucket_size_mb`` is not a number, ``grad_dtype`` not None or a floating
            dtype; and as :class:`~llmsys.ddp.base.DataParallelBase`.
        ValueError: ``bucket_size_mb`` is not finite and positive; and as
            :class:`~llmsys.ddp.base.DataParallelBase`.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float = 25.0,
        grad_dtype: torch.dtype | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
    ):
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
            raise TypeError(f"bucket_size_mb must be a number, got {type(bucket_size_mb).__name__}")
        if not 0 < bucket_size_mb < math.inf:  # NaN fails too
            raise ValueError(f"bucket_size_mb must be a finite number > 0, got {bucket_size_mb}")
        if grad_dtype is not None and not (
            isinstance(grad_dtype, torch.dtype) and grad_dtype.is_floating_point
        ):
            raise TypeError(
                f"grad_dtype must be None or a floating torch.dtype, got {grad_dtype!r}"
            )
        self.bucket_size_mb = float(bucket_size_mb)
        self.grad_dtype = grad_dtype

        def by_size(params: list[nn.Parameter]) -> tuple[list[list[int]], list[torch.dtype]]:
            wire = [grad_dtype or p.dtype for p in params]
            nbytes = [p.numel() * w.itemsize for p, w in zip(params, wire, strict=True)]
            return group_buckets(nbytes, bucket_size_mb, kinds=wire), wire

        super().__init__(module, by_size, process_group=process_group)
