"""``ShardedOptimizer``: ZeRO stage 1, the optimizer state sharded across data-parallel ranks.

In data parallelism every rank holds all parameters and, after the gradient all-reduce, all
averaged gradients; a plain optimizer then repeats the same update on every rank and keeps a
full copy of its state on each (AdamW: two fp32 tensors per parameter, twice the fp32 weights).
ZeRO stage 1 (Rajbhandari et al. 2019, arXiv 1910.02054) updates each parameter on one rank
only, its owner (``ownership.py``), which alone keeps its state; owners then send the updated
parameters to the other ranks (``resync.py``).

One training step, on every rank:

    loss.backward()                    # the caller's DDP (or all-reduce) averages the gradients
    optimizer.clip_grad_norm_(1.0)     # optional: the norm over all gradients, no communication
    optimizer.step()
        1. copy each param group's options (lr set by a scheduler, ...) to the local optimizer
        2. local_optimizer.step()      # optimizer_cls on the owned parameters: ~1/N of the work
        3. broadcast_from_owners()     # each rank receives the parameters it does not own
    optimizer.zero_grad()

The re-sync (3) is a broadcast from each owner, of buckets: large parameters alone and in place,
small ones packed into flat buffers of up to 32 MiB. Not per parameter, as torch's
ZeroRedundancyOptimizer does (one collective launch per tensor), and not an all-gather of flat
shards (a padded, model-sized flat buffer on every rank): ``resync.py`` explains the choice.

Two lists of param groups are kept, index for index:

- ``optimizer.param_groups``: every parameter, as in a plain optimizer, so that LR schedulers,
  ``zero_grad`` and gradient clipping see the whole model and every rank has the same options;
- ``optimizer.local_optimizer.param_groups``: the same groups with only the owned parameters (a
  group may be empty on some rank), the options copied over before each step.

``optimizer.state`` is the local optimizer's state: the owned parameters' only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .checkpoint import gather_state, unpack_full_state_dict
from .comm import all_gathered, check_same_parameters, rank_and_world_size
from .ownership import Ownership, assign_owners
from .resync import broadcast_from_owners, make_buckets

NAME = "ShardedOptimizer"


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` over this rank's share of the parameters, the others kept in sync.

    Args:
        params: tensors, or param-group dicts (``{"params": [...], "lr": 1e-3}``), as for any
            optimizer. Every rank passes the same parameters (shapes, dtypes, order). A tensor
            listed twice in a group (tied weights) counts once; one in two groups is an error.
        optimizer_cls: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.AdamW``.
        **kwargs: options for ``optimizer_cls`` (``lr``, ``betas``, ``weight_decay``,
            ``fused``, ...), the defaults of groups that do not set them.

    Uses the default process group. Without one, or in a world of one rank, it runs
    ``optimizer_cls`` over every parameter and never communicates. Each rank's gradients must
    already be averaged over the ranks (DDP, or an all-reduce) when :meth:`step` runs.

    Attributes:
        rank, world_size: this process's place in the default group ((0, 1) without one).
        ownership: the :class:`~llmsys.sharded_optim.Ownership` (owner of each global index).
        local_optimizer: the ``optimizer_cls`` instance over the owned parameters.

    Raises:
        TypeError: ``optimizer_cls`` is not a ``torch.optim.Optimizer`` subclass (or is
            ``ShardedOptimizer``), or ``params`` does not hold tensors or param-group dicts.
        ValueError: a parameter is not a leaf or is in two groups, or the ranks' parameters
            differ (shapes, dtypes, order or values; CPU parameters under NCCL).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> None:
        is_class = isinstance(optimizer_cls, type)
        if not (is_class and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                f"{NAME}: `optimizer_cls` must be a torch.optim.Optimizer subclass (the class, "
                f"e.g. torch.optim.AdamW), got {optimizer_cls!r}"
            )
        if issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError(f"{NAME}: `optimizer_cls` cannot be {NAME} itself (nothing to nest)")
        self.rank, self.world_size = rank_and_world_size()
        # None while Optimizer.__init__ adds the groups one by one: they are assigned together
        # below, so that the sorted-greedy order runs over every parameter at once.
        self.ownership: Ownership | None = None
        self._consolidated: dict[int, dict] | None = None
        self._consolidated_to: int | None = None
        super().__init__(_param_groups_of(params), defaults=dict(kwargs))

        all_params = self._all_params()
        check_same_parameters(all_params, NAME)
        self.ownership = assign_owners([p.numel() for p in all_params], self.world_size)
        owned = {id(all_params[i]) for i in self.ownership.params_of(self.rank)}
        local_groups = [
            _with_params(group, [p for p in group["params"] if id(p) in owned])
            for group in self.param_groups
        ]
        self.local_optimizer = optimizer_cls(local_groups, **kwargs)
        # The local optimizer filled in the options nobody passed (betas, eps, foreach, ...):
        # give them to the outer groups too, so schedulers and state_dict() see every option.
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            _fill_missing_options(group, local)
        self.defaults = dict(self.local_optimizer.defaults)
        self.state = self.local_optimizer.state
        self._buckets = make_buckets(all_params, self.ownership.owners)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of new parameters (also during training) and give each an owner.

        Args:
            param_group: ``{"params": tensors, **options}``; options it leaves out take the
                optimizer's defaults. Call on every rank with the same parameters.
        """
        group = self._checked_group(param_group)
        if self.ownership is None:  # from Optimizer.__init__: the constructor assigns owners after
            super().add_param_group(group)
            return
        check_same_parameters([*self._all_params(), *group["params"]], f"{NAME}.add_param_group")
        super().add_param_group(group)
        group, all_params = self.param_groups[-1], self._all_params()
        ownership = self.ownership.extend([p.numel() for p in group["params"]])
        owners = ownership.owners[len(self.ownership.owners) :]
        owned = [p for p, owner in zip(group["params"], owners, strict=True) if owner == self.rank]
        try:
            self.local_optimizer.add_param_group(_with_params(group, owned))
        except Exception:
            self.param_groups.pop()  # all or nothing: the outer and local groups stay paired
            raise
        self.ownership = ownership
        _fill_missing_options(group, self.local_optimizer.param_groups[-1])
        self._buckets = make_buckets(all_params, self.ownership.owners)
        self._consolidated = None

    @property
    def plan(self) -> Ownership | None:
        """The earlier name of :attr:`ownership`, kept for users."""
        return self.ownership

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Update the owned parameters, then receive every other parameter from its owner.

        Args:
            closure: re-evaluates the model and returns the loss, passed to the local
                optimizer's ``step``; it runs on every rank, so any collectives inside it (a
                DDP backward) must run the same number of times on every rank.
            **kwargs: passed to the local optimizer's ``step``.

        Returns:
            What the local optimizer's ``step`` returns (the closure's loss, or None).

        Raises:
            Whatever the local step raises (it sees only the owned parameters, so it can fail on
            some ranks alone, e.g. a sparse gradient with Adam). The failing rank still takes
            part in the broadcasts first, so no other rank hangs waiting for it; the job must
            stop, since the failing rank's parameters were not updated.
        """
        self._consolidated = None
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local.update((key, value) for key, value in group.items() if key != "params")
        try:
            return self.local_optimizer.step(closure=closure, **kwargs)
        finally:
            if self.world_size > 1:
                broadcast_from_owners(self._buckets, self.rank)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so that their global norm is at most ``max_norm``.

        In ZeRO-1 every rank holds all averaged gradients, so the norm over all parameters is
        already the global one: no communication, and the result equals
        ``torch.nn.utils.clip_grad_norm_`` over the model in unsharded training. (A norm over
        only the owned gradients would be about 1/sqrt(N) of it and clip too little.)

        Args:
            max_norm: the largest allowed norm (a non-negative number; ``inf`` never clips).
            norm_type: the p of the p-norm, a positive number; ``float("inf")`` for the
                largest magnitude. Default 2.

        Returns:
            The norm of all gradients before clipping (a 0-dim tensor).

        Raises:
            TypeError: ``max_norm`` or ``norm_type`` is not a number.
            ValueError: ``max_norm`` is negative or NaN, ``norm_type`` not positive or NaN
                (no gradient is touched then).
        """
        where = f"{NAME}.clip_grad_norm_"
        for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{where}: `{name}` must be a number, got {type(value).__name__}")
        if not max_norm >= 0:  # NaN fails too: it would turn every gradient into NaN
            raise ValueError(f"{where}: `max_norm` must be a non-negative number, got {max_norm!r}")
        if not norm_type > 0:
            raise ValueError(
                f"{where}: `norm_type` must be a positive number or inf, got {norm_type!r}"
            )
        grads = [p for p in self._all_params() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (on CPU), for :meth:`state_dict`.

        Call on every rank (it communicates); then ``state_dict()`` on rank ``to`` returns the
        full state dict. A later ``step``, ``add_param_group`` or ``load_state_dict`` discards
        the gathered copy.

        Args:
            to: the rank that receives the state, in ``0..world_size-1``. Default 0.

        Raises:
            ValueError: ``to`` is not a rank in ``0..world_size-1``.
        """
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(
                f"{NAME}.consolidate_state_dict: `to` must be a rank in 0..{self.world_size - 1}, "
                f"got {to!r}"
            )
        all_params = self._all_params()
        assert self.ownership is not None  # (None only inside Optimizer.__init__)
        owned = {}
        for i in self.ownership.params_of(self.rank):
            state = self.state.get(all_params[i])
            if state:  # parameters that never had a gradient have no state
                owned[i] = state
        self._consolidated = gather_state(owned, to)
        self._consolidated_to = to

    def state_dict(self) -> dict[str, Any]:
        """The full state dict, after :meth:`consolidate_state_dict` put it on this rank.

        Returns:
            ``{"state": {global index: state}, "param_groups": [options and "params" as global
            indices]}``: the format of ``optimizer_cls(all params).state_dict()``, state tensors
            on CPU, options as they are now. It loads into a :class:`ShardedOptimizer` of any
            world size or into a plain ``optimizer_cls``.

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` did not gather the state on this rank
                since the last ``step``, ``add_param_group`` or ``load_state_dict``.
        """
        if self._consolidated is None:
            where = (
                "the state was gathered on another rank, "
                if self._consolidated_to not in (None, self.rank)
                else ""
            )
            raise RuntimeError(
                f"{NAME}.state_dict(): {where}this rank holds only its own shard of the state. "
                "Call consolidate_state_dict(to=rank) on every rank first (after the last "
                "step), then state_dict() on that rank."
            )
        param_groups, start = [], 0
        for group in self.param_groups:
            options = {key: value for key, value in group.items() if key != "params"}
            indices = list(range(start, start + len(group["params"])))
            param_groups.append({**options, "params": indices})
            start += len(indices)
        return {"state": self._consolidated, "param_groups": param_groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict, from any world size or a plain optimizer. Call on every rank
        with the same dict: each rank keeps the state of the parameters it owns.

        Args:
            state_dict: a full state dict (see :meth:`state_dict`); its param groups must have
                this optimizer's group sizes.

        Raises:
            TypeError, ValueError: ``state_dict`` does not fit this optimizer.
            RuntimeError: after loading, the parameters with state on all ranks together are
                not exactly those with state in ``state_dict`` (ranks loaded different dicts).
        """
        sizes = [len(group["params"]) for group in self.param_groups]
        state, options = unpack_full_state_dict(state_dict, sizes)
        index = {id(p): i for i, p in enumerate(self._all_params())}
        local_state, local_groups, k = {}, [], 0
        for group, saved, local in zip(
            self.param_groups, options, self.local_optimizer.param_groups, strict=True
        ):
            group.update(saved)
            local_ids = []
            for param in local["params"]:  # the local optimizer numbers its own parameters
                if index[id(param)] in state:
                    local_state[k] = state[index[id(param)]]
                local_ids.append(k)
                k += 1
            local_groups.append({**saved, "params": local_ids})
        expected = sum(1 for values in state.values() if values)
        local_dict = {"state": local_state, "param_groups": local_groups}
        try:
            self.local_optimizer.load_state_dict(local_dict)
        except Exception:
            all_gathered((expected, -1))  # the others' check fails too, instead of hanging
            raise
        self.state = self.local_optimizer.state  # load_state_dict replaced the dict
        self._consolidated = None
        self._check_state_loaded_once(expected)

    # ---- helpers ------------------------------------------------------------------------------

    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter, in global index order (group by group)."""
        return [p for group in self.param_groups for p in group["params"]]

    def _checked_group(self, param_group: Any) -> dict[str, Any]:
        """A copy of ``param_group`` with ``params`` as a list of distinct leaf tensors that no
        other group has; TypeError / ValueError naming the problem otherwise."""
        where = NAME if self.ownership is None else f"{NAME}.add_param_group"
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(
                f"{where}: `param_group` must be a dict with a 'params' entry, got "
                f"{sorted(param_group) if isinstance(param_group, dict) else type(param_group)}"
            )
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, (set, frozenset)) or not isinstance(params, Iterable):
            raise TypeError(
                f"{where}: `params` must be a tensor or an ordered iterable of tensors (every rank "
                f"must see the same order), got {type(params).__name__}"
            )
        taken = {id(p): g for g, group in enumerate(self.param_groups) for p in group["params"]}
        distinct: dict[int, torch.Tensor] = {}
        for position, param in enumerate(params):
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"{where}: `params` must hold tensors, got {type(param).__name__} at "
                    f"position {position}"
                )
            if not param.is_leaf:
                raise ValueError(
                    f"{where}: `params` must hold leaf tensors (nn.Parameter or a tensor "
                    f"created by the user), got a tensor computed by {param.grad_fn} at "
                    f"position {position}"
                )
            if id(param) in taken:
                raise ValueError(
                    f"{where}: a parameter can be in one param group only; `params` position "
                    f"{position} (shape {tuple(param.shape)}) is already in param group "
                    f"{taken[id(param)]}"
                )
            distinct.setdefault(id(param), param)  # tied weights: once
        return {**param_group, "params": list(distinct.values())}

    def _check_state_loaded_once(self, expected: int) -> None:
        """Raise on every rank unless the ranks together now hold state for exactly the
        ``expected`` parameters that have state in the loaded dict, each on its owner."""
        all_params = self._all_params()
        assert self.ownership is not None  # (None only inside Optimizer.__init__)
        loaded = sum(
            1 for i in self.ownership.params_of(self.rank) if self.state.get(all_params[i])
        )
        counts = all_gathered((expected, loaded))  # (expected, loaded) of each rank
        if len({e for e, _ in counts}) > 1 or sum(n for _, n in counts) != expected:
            raise RuntimeError(
                f"{NAME}.load_state_dict: every parameter's state must be loaded exactly once, "
                f"on its owner; got (parameters with state in the dict, loaded here) per rank: "
                f"{counts}. Every rank must load the same full state dict."
            )


def _param_groups_of(params: Any) -> list[dict[str, Any]]:
    """``params`` as a non-empty list of group dicts (a list of tensors is one group)."""
    if isinstance(params, (torch.Tensor, dict)) or not isinstance(params, Iterable):
        raise TypeError(
            f"{NAME}: `params` must be an iterable of tensors or of param-group dicts, got "
            f"{type(params).__name__}"
        )
    if isinstance(params, (set, frozenset)):
        raise TypeError(
            f"{NAME}: `params` must be an ordered iterable (a list), got a "
            f"{type(params).__name__}: ranks may iterate a set in different orders and then "
            "disagree on which rank owns which parameter"
        )
    items = list(params)
    if not items:
        raise ValueError(f"{NAME}: `params` must hold at least one parameter, got an empty list")
    if all(isinstance(item, dict) for item in items):
        return items
    if any(isinstance(item, dict) for item in items):
        raise TypeError(f"{NAME}: `params` must hold either tensors or dicts, got a mix")
    return [{"params": items}]


def _with_params(group: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """``group``'s options with other ``params``."""
    return {**{key: value for key, value in group.items() if key != "params"}, "params": params}


def _fill_missing_options(group: dict[str, Any], source: dict[str, Any]) -> None:
    for key, value in source.items():
        if key != "params":
            group.setdefault(key, value)
