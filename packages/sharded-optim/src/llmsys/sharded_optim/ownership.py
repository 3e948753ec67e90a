"""Which rank owns which parameter: a sorted-greedy partition of element counts.

ZeRO stage 1 keeps each parameter's optimizer state on one rank only, its owner. Whole tensors
are assigned (a tensor is never split), so the owners balance element counts as well as whole
tensors allow:

    order the parameters largest first (ties: lower index first)
    give each one to the rank with the fewest elements so far (ties: lower rank)

Bound: the last parameter a rank receives went to the least-loaded rank, whose load was then at
most the average, ``total / N``; so no rank ends above ``total / N + largest``. An unsorted
greedy pass has the same bound, but sorting makes the final, smallest tensors fill the gaps
(12 tensors of sizes 1..12 on 3 ranks: 26 / 26 / 26 sorted, against 22 / 26 / 30 in index
order).

The owners are a pure function of the element counts and the world size, so every rank computes
the same owners without talking to the others. Parameters added later (``add_param_group``) are
placed by :meth:`Ownership.extend`, around the loads already there, keeping the bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Ownership:
    """The owning rank of every parameter, by its global index.

    The global index is a parameter's position when all param groups' ``params`` are read in
    order, as ``torch.optim.Optimizer.state_dict`` numbers them.

    Attributes:
        world_size: the number of ranks N (>= 1).
        owners: ``owners[i]`` is the rank that owns parameter ``i`` (in 0..N-1).
        loads: ``loads[r]`` is the number of elements rank ``r`` owns.

    Raises:
        TypeError: ``owners`` or ``loads`` is not a tuple.
        ValueError: ``world_size`` is not a positive int, an owner not a rank in 0..N-1, or
            ``loads`` not N non-negative ints.
    """

    world_size: int
    owners: tuple[int, ...] = ()
    loads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = self.world_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Ownership: `world_size` must be a positive int, got {n!r}")
        for name in ("owners", "loads"):
            if not isinstance(getattr(self, name), tuple):
                raise TypeError(
                    f"Ownership: `{name}` must be a tuple of ints, got "
                    f"{type(getattr(self, name)).__name__}"
                )
        for i, owner in enumerate(self.owners):
            if not _is_int(owner) or not 0 <= owner < n:
                raise ValueError(
                    f"Ownership: `owners` must hold ranks in 0..{n - 1} (world_size={n}), got "
                    f"{owner!r} at position {i}"
                )
        if not self.loads:  # a new ownership: nothing owned yet
            object.__setattr__(self, "loads", (0,) * n)
        if len(self.loads) != n:
            raise ValueError(
                f"Ownership: `loads` must have one entry per rank ({n}), got {len(self.loads)}"
            )
        for rank, load in enumerate(self.loads):
            if not _is_int(load) or load < 0:
                raise ValueError(
                    f"Ownership: `loads` must hold non-negative ints, got {load!r} for rank {rank}"
                )

    def params_of(self, rank: int) -> list[int]:
        """Global indices of the parameters ``rank`` owns, in increasing order.

        Raises:
            ValueError: ``rank`` is not an int in 0..world_size-1.
        """
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"Ownership.params_of: `rank` must be an int in 0..{self.world_size - 1}, "
                f"got {rank!r}"
            )
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def extend(self, numels: Sequence[int]) -> Ownership:
        """This ownership with parameters of ``numels`` elements appended (indices ``len(owners)``
        on), each placed sorted-greedily on top of the current loads."""
        _check_numels(numels)
        loads = list(self.loads)
        new_owners = [0] * len(numels)
        for i in sorted(range(len(numels)), key=lambda i: -numels[i]):  # stable: ties by index
            rank = min(range(self.world_size), key=loads.__getitem__)  # ties: lowest rank
            new_owners[i] = rank
            loads[rank] += numels[i]
        return Ownership(self.world_size, self.owners + tuple(new_owners), tuple(loads))


def assign_owners(numels: Sequence[int], world_size: int) -> Ownership:
    """Assign parameters with ``numels[i]`` elements to ``world_size`` ranks, largest first to
    the least-loaded rank.

    Args:
        numels: element count of each parameter, in global index order (non-negative ints).
        world_size: the number of ranks (a positive int).

    Returns:
        A :class:`Ownership`; its largest load is at most ``sum(numels) / world_size +
        max(numels)``.
    """
    return Ownership(world_size).extend(numels)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numels(numels: Sequence[int]) -> None:
    if not isinstance(numels, Sequence) or isinstance(numels, str):
        raise TypeError(
            f"Ownership: `numels` must be a sequence of ints, got {type(numels).__name__}"
        )
    for i, n in enumerate(numels):
        if not _is_int(n) or n < 0:
            raise ValueError(
                f"Ownership: `numels` must hold non-negative ints, got {n!r} at position {i}"
            )
