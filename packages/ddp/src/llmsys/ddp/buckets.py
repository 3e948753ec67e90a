"""The buckets: which gradients travel together in one all-reduce.

A pure function of the parameters' sizes, so every rank computes the same buckets from the
same model (collectives are matched by the order they are issued in; two ranks with different
buckets would pair unrelated tensors) and the grouping can be tested alone.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

MIB = 1024 * 1024


def group_buckets(
    nbytes: Sequence[int],
    bucket_size_mb: float,
    kinds: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """Group parameters into buckets of at most ``bucket_size_mb`` MiB, in reverse order.

    Args:
        nbytes: bytes of each parameter's gradient on the wire, in registration order.
        bucket_size_mb: the cap per bucket in MiB (2**20 bytes, as torch DDP's
            ``bucket_cap_mb``); a parameter larger than the cap gets a bucket of its own.
        kinds: optional key per parameter (for example its dtype); a bucket never mixes
            kinds, because one all-reduce moves one dtype.

    Raises:
        TypeError: ``bucket_size_mb`` is not a number, ``nbytes`` not a sequence.
        ValueError: ``bucket_size_mb`` is not finite and positive, an ``nbytes`` entry is not a
            non-negative int, or ``kinds`` has another length.

    Returns:
        Lists of parameter indices. Buckets come in the order backward produces gradients:
        the last registered parameter first. Inside a bucket indices are in that same order.
    """
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
        raise TypeError(
            f"group_buckets: `bucket_size_mb` must be a number, got {type(bucket_size_mb).__name__}"
        )
    if not 0 < bucket_size_mb < math.inf:  # NaN fails too
        raise ValueError(
            f"group_buckets: `bucket_size_mb` must be a finite number > 0, got {bucket_size_mb}"
        )
    if not isinstance(nbytes, Sequence) or isinstance(nbytes, str):
        raise TypeError(f"group_buckets: `nbytes` must be a sequence of ints, got {nbytes!r}")
    for index, n in enumerate(nbytes):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(
                f"group_buckets: `nbytes` must hold non-negative ints, got {n!r} at position "
                f"{index}"
            )
    if kinds is not None and len(kinds) != len(nbytes):
        raise ValueError(
            f"kinds must have one entry per parameter ({len(nbytes)}), got {len(kinds)}"
        )
    cap = bucket_size_mb * MIB
    buckets: list[list[int]] = []
    filled = 0.0
    for index in reversed(range(len(nbytes))):
        same_kind = kinds is None or not buckets or kinds[buckets[-1][-1]] == kinds[index]
        if buckets and same_kind and filled + nbytes[index] <= cap:
            buckets[-1].append(index)
            filled += nbytes[index]
        else:
            buckets.append([index])
            filled = nbytes[index]
    return buckets


plan_buckets = group_buckets  # the earlier name, kept for users
