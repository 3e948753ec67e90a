"""Fully sharded data parallel: each rank keeps 1/N of every weight, its gradient and its
optimizer state, and gathers a layer's full weight only while the layer needs it.

Which parameters are sharded, the rule: every parameter with two dimensions. In a language model
those are the weights of matmuls (``(out, in)``) and lookups (``(num, dim)``), whatever class
holds them (``nn.Linear``, ``nn.Embedding`` or the user's own layer), and they hold nearly all the
bytes. Parameters of other ranks (norm gains, biases, scalars) are small: every rank keeps them
whole and their gradients are all-reduced, as under DDP.

A sharded parameter's ``.data`` becomes this rank's flat slice: the weight flattened, padded with
zeros to a multiple of N and cut in N equal pieces. Weights are handled a block at a time: a
block is an item of the innermost ``nn.ModuleList`` around them (a Transformer's layer; one
expert of a list of experts); the modules outside every list form one block, the whole
model's, full from the first of them to run to the end of the model's forward.

    first module to run  all-gather the block's slices (or take the ones prefetched); every
                        owning module's attribute now reads its full weight, through one
                        autograd node per block; issue the next block's all-gather
    forward             the layers run; autograd saves a token, not the full weight
    block's forward hook drop the full weights
    backward            a token's first use gathers the block's saved weights again
                        (prefetching the block before it); once the block's gradients have
                        arrived, the full copies go and the gradients are reduce-scattered, in
                        one collective and asynchronously, into this rank's slices (summed;
                        divided by N once at the end)

so a rank holds its slices plus the few full blocks in flight. One collective per block, not per
weight matrix, and one hook's work per block, not per layer, because the host pays each a fixed
time (a collective about 0.2 ms on an H100 host) that a step of a hundred layers would otherwise
pay hundreds of times. ``blocks_per_gather`` consecutive items share their collectives too.
``finish_gradient_synchronization`` waits for the reduce-scatters, hands each slice its gradient
and averages the replicated parameters' gradients.

A sharded weight must be read inside the ``forward`` of its block (as every layer reads its own
weights, and a fused loss in the model's forward reads the output layer's); read elsewhere it is
the 1-D slice. A checkpoint that recomputes part of a block in
backward gathers the whole block.

This module is the schedule: the wrapper and its hooks, which decide when a block is gathered,
dropped and reduce-scattered. The slices and the collectives themselves are ``shards.py``'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from numbers import Integral
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from .base import DataParallelBase
from .shards import Gather, ReduceScatter, Shard, is_sharded
from .wrappers import all_reduce_flat

# (owner module, attribute name, parameter), and a unit: (its module, its attributes)
_Attribute = tuple[nn.Module, str, nn.Parameter]
_Unit = tuple[nn.Module, list[_Attribute]]

IN_FLIGHT_REDUCE_SCATTERS = 2  # beyond this, the oldest is waited for (its full gradients freed)


def _check_flags(owner: str, **flags: object) -> None:
    """Each of ``flags`` a bool, else a ``TypeError`` naming it."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{owner}: `{name}` must be a bool, got {type(value).__name__}")


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpoint's
    recomputation runs the forward there)."""
    return torch._C._current_graph_task_id() != -1


class _Use:
    """One forward use of a sharded weight: its full copy while forward or backward needs it."""

    def __init__(self, shard: Shard, unit: int):
        self.shard, self.unit = shard, unit
        self.full: torch.Tensor | None = None  # (shape) in the compute dtype, when gathered
        self.gather: _Gathering | None = None  # the all-gather still running for it, if any
        self.saved = False  # autograd saved it: backward will gather it again
        self.previous: _Use | None = None  # the last use of the block before, in the forward
        self.cohort: list[_Use] = [self]  # the uses gathered with it in forward
        self.cohort_grads = int(shard.param.requires_grad)  # gradients the cohort will receive


class _Gathering(NamedTuple):
    """An all-gather in flight and the uses whose full weights it brings."""

    gather: Gather
    uses: list[_Use]


class _SavedWeight:
    """What autograd keeps of a full weight: a way to gather it again."""

    def __init__(self, use: _Use, tensor: torch.Tensor):
        self.use = use
        self.view = (tensor.size(), tensor.stride(), tensor.storage_offset())


class _GatheredWeights(torch.autograd.Function):
    """A block's shards -> their full weights (already gathered into each ``use.full``): one
    autograd node per block, whose backward runs once every weight's gradient has arrived and
    hands them to the reduce-scatter."""

    @staticmethod
    def forward(
        ctx: Any, fsdp: FSDP, uses: list[_Use], *shards: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        ctx.fsdp, ctx.uses = fsdp, uses
        ctx.set_materialize_grads(False)  # a weight the forward did not use gets None
        return tuple(use.full for use in uses)

    @staticmethod
    def backward(ctx: Any, *grads_full: torch.Tensor | None) -> tuple[None, ...]:
        for use, grad_full in zip(ctx.uses, grads_full, strict=True):
            if grad_full is not None:
                ctx.fsdp._gradient_arrived(use, grad_full)
        return (None, None) + (None,) * len(grads_full)


class FSDP(DataParallelBase):
    """Fully sharded data parallel over the ranks of ``torch.distributed`` (or one process).

    Args:
        module: the model, on one device (the GPU of this rank under NCCL). Every rank must
            build the same model; rank 0's values win. It stays reachable as ``.module`` and
            its 2-D parameters become this rank's slices (see the module docstring).
        compute_dtype: ``None`` (compute in the parameters' dtype) or a floating dtype such as
            ``torch.bfloat16`` for mixed precision, by this policy:

            - a layer that holds a weight of two or more dimensions (``nn.Linear``,
              ``nn.Embedding``, a user's matmul layer, a stack of experts) runs in
              ``compute_dtype``, forward and backward: its floating parameters (the weight and
              its bias) and the floating tensors passed to it are cast. Sharded weights are
              cast before the all-gather (fewer bytes on the wire);
            - every other layer keeps its parameters' dtype: a norm's gain stays float32 (the
              norm's output has whatever dtype its forward makes; the next layer casts it);
            - the master weights, the gradients the optimizer sees and its state stay in the
              parameters' dtype: each gradient is cast to it before it is reduced, so the
              reduce-scatter (and the replicated parameters' all-reduce) sums in float32.

            Nothing else is cast: not the model's own arithmetic between layers, its buffers or
            its outputs, and not a weight read outside its layer (a fused loss reading the
            output layer's weight gets it in ``compute_dtype`` and must bring its input in that
            dtype). On one process, the same policy is the model with each such layer's
            parameters and inputs cast (``tests/test_fsdp.py``'s ``mixed_precision``).
        process_group: the ranks to shard over (default: all).
        blocks_per_gather: how many consecutive items of each innermost ``nn.ModuleList`` (a
            Transformer's layers; a list of experts too) travel together, in one all-gather and
            one reduce-scatter (default 1). Each collective costs the host a fixed time: 2
            halves the collectives of a step whose host cannot keep up with the GPU. Forward
            holds up to two groups' full weights (the one computing, the next one arriving):
            2 x blocks_per_gather layers.

    Call ``finish_gradient_synchronization()`` after ``backward()`` and before the optimizer
    step. ``gather_full_params()``, ``state_dict()`` and ``load_state_dict()`` work with full
    tensors under the unwrapped module's names; every rank must call them (they communicate).

    Raises:
        TypeError: ``blocks_per_gather`` is not an int, ``compute_dtype`` not None or a floating
            dtype; and as :class:`~llmsys.ddp.base.DataParallelBase`.
        ValueError: ``blocks_per_gather`` < 1; and as :class:`~llmsys.ddp.base.DataParallelBase`.
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        blocks_per_gather: int = 1,
    ):
        if isinstance(blocks_per_gather, bool) or not isinstance(blocks_per_gather, Integral):
            raise TypeError(
                f"blocks_per_gather must be an int, got {type(blocks_per_gather).__name__}"
            )
        if blocks_per_gather < 1:
            raise ValueError(f"blocks_per_gather must be >= 1, got {blocks_per_gather}")
        blocks_per_gather = int(blocks_per_gather)
        if compute_dtype is not None and not (
            isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        ):
            raise TypeError(
                f"compute_dtype must be None or a floating torch.dtype, got {compute_dtype!r}"
            )
        super().__init__(module, process_group=process_group)
        self.compute_dtype: torch.dtype | None = compute_dtype
        # (decided before sharding, which leaves every parameter 1-D)
        cast_layers = [m for m in module.modules() if runs_in_compute_dtype(m)]
        self._shards: dict[nn.Parameter, Shard] = {}
        for name, param in module.named_parameters():
            if is_sharded(param):
                shard = Shard(param, name, self.rank, self.world_size)
                param.data = shard.slice_of(param)
                self._shards[param] = shard
        self._claim_module(for_good=True)  # sharded in place: never wrap it again
        # A unit: a block (an item of the innermost nn.ModuleList) or a module outside every
        # list, with the (owner, attribute, parameter) triples it gathers or casts.
        self._units: list[_Unit] = _units(
            module, self._shards, cast_layers if compute_dtype else []
        )
        self._group_of: list[int] = _blocks(
            module, [site for site, _ in self._units], blocks_per_gather
        )
        self._sharded_of: list[list[_Attribute]] = [
            [(o, n, p) for o, n, p in attributes if p in self._shards]
            for _, attributes in self._units
        ]
        self._group_units: dict[int, list[int]] = {}  # group -> its units with sharded weights
        for unit, sharded in enumerate(self._sharded_of):
            if sharded:
                self._group_units.setdefault(self._group_of[unit], []).append(unit)
        for unit, (site, attributes) in enumerate(self._units):
            # The first of a unit's modules to run makes the whole unit's weights full; the
            # unit's own forward hook drops them, also when its forward raises (a checkpoint's
            # recomputation stops that way). Each owner's pre-hook is one dict lookup once its
            # unit is active: a checkpoint recomputing one owner in backward, outside its
            # block's forward, still finds its weights.
            site.register_forward_pre_hook(lambda m, args, u=unit: self._running.add(u))
            for owner in dict.fromkeys(owner for owner, _, _ in attributes):
                owner.register_forward_pre_hook(lambda m, args, u=unit: self._enter(u))
                if compute_dtype is not None:  # (every owner runs in compute_dtype)
                    owner.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
            site.register_forward_hook(
                lambda m, args, out, u=unit: self._leave(u), always_call=True
            )
        self._order: list[int] = []  # units with sharded weights, in the last forward's order
        self._position: int = 0  # how many of them ran in this forward
        self._prefetched: dict[int, list[_Use]] = {}
        self._finished: set[int] = set()  # units whose gradients arrived in this backward
        # unit -> (its uses, whether autograd records them) while its forward runs
        self._active: dict[int, tuple[list[_Use], bool]] = {}
        self._running: set[int] = set()  # units whose own module's forward is running
        self._live: dict[int, _Use] = {}  # storage address of a full weight in forward -> use
        self._last_use: _Use | None = None
        self._pending: list[tuple[_Use, torch.Tensor]] = []  # a block's full gradients so far
        self._reducing: deque[ReduceScatter] = deque()  # in flight
        self._reduced: list[tuple[Shard, torch.Tensor]] = []  # slice sums ready for .grad

    # -- the public contract ----------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._position, self._last_use = 0, None
        self._finished.clear()
        # Full weights left by a block's module called on its own since the last forward may
        # predate an optimizer step: gather afresh.
        self._drop_prefetched()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            self._drop_prefetched()

    def finish_gradient_synchronization(self) -> None:
        """Wait until every slice's gradient holds its mean over ranks, and every replicated
        parameter's gradient too. Call after ``backward()``, before ``optimizer.step()``."""
        if self._pending:
            self._reduce_pending()
        while self._reducing:
            self._finish_oldest_reduce_scatter()
        self._drop_prefetched()
        sums: dict[Shard, torch.Tensor] = {}
        for shard, piece in self._reduced:
            sums[shard] = piece if shard not in sums else sums[shard].add_(piece)
        self._reduced = []
        if sums:
            torch._foreach_div_(list(sums.values()), self.world_size)
        grads = []
        for shard, total in sums.items():
            param = shard.param
            if param.grad is None:
                param.grad = total
            else:
                grads.append((param.grad, total))
        if grads:
            torch._foreach_add_([g for g, _ in grads], [t for _, t in grads])
        super().finish_gradient_synchronization()

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter at full size, under the unwrapped module's names (a copy)."""
        return {name: self._gather_full(param) for name, param in self.module.named_parameters()}

    # torch types state_dict as two overloads with a keyword-only destination; this one keeps
    # the positional destination torch itself accepts.
    def state_dict(  # type: ignore[override]
        self, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The unwrapped module's full state dict (parameters gathered, on the CPU).

        Raises:
            TypeError: ``keep_vars`` is not a bool.
        """
        _check_flags("FSDP.state_dict", keep_vars=keep_vars)
        out = {} if destination is None else destination
        for name, value in self.module.state_dict(keep_vars=True).items():
            full = self._gather_full(value) if value in self._shards else value.detach()
            out[prefix + name] = full.cpu()
        return out

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a full state dict (from ``state_dict()`` on any world size, or an unwrapped
        model's) into this rank's slices and replicated parameters.

        Raises:
            TypeError: ``strict`` or ``assign`` is not a bool.
            ValueError: ``assign=True``, or a sharded parameter's entry is not a tensor of its
                full shape.
        """
        _check_flags("FSDP.load_state_dict", strict=strict, assign=assign)
        if assign:
            raise ValueError("FSDP.load_state_dict: assign=True is not supported")
        owned = self.module.state_dict(keep_vars=True)
        local = dict(state_dict)
        for name, value in owned.items():
            shard = self._shards.get(value) if isinstance(value, nn.Parameter) else None
            if shard is None or name not in local:
                continue
            full = local[name]
            if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(shard.shape):
                got = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
                raise ValueError(
                    f"FSDP.load_state_dict: {name!r} must be a tensor of the full shape "
                    f"{tuple(shard.shape)}, got {got}"
                )
            local[name] = shard.slice_of(full.to(value.device, value.dtype))
        return self.module.load_state_dict(local, strict=strict)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient so that their global 2-norm (all slices and the replicated
        parameters) is at most ``max_norm``; returns the norm before clipping. Call it after
        ``finish_gradient_synchronization()``.

        Raises:
            TypeError: ``max_norm`` is not a number.
            ValueError: ``max_norm`` is not > 0 (NaN included).
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        sliced = [s.param.grad for s in self._shards.values() if s.param.grad is not None]
        whole = [p.grad for p in self.params if p.grad is not None]
        device = next(self.module.parameters()).device
        dtype = torch.float64 if any(g.dtype == torch.float64 for g in sliced + whole) else None
        squares = torch.zeros(2, dtype=dtype or torch.float32, device=device)
        for i, grads in enumerate((sliced, whole)):
            if grads:
                squares[i] = torch.stack([g.to(squares.dtype).pow(2).sum() for g in grads]).sum()
        if self.world_size > 1:
            sliced_sum = squares[:1].clone()
            dist.all_reduce(sliced_sum, group=self.process_group)  # replicated: same everywhere
            squares[0] = sliced_sum[0]
        norm = squares.sum().sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if sliced or whole:
            torch._foreach_mul_(sliced + whole, scale)
        return norm

    def remove_hooks(self) -> None:
        """Not supported: the parameters stay sharded for good.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            "FSDP shards the module's parameters in place; to use the model without it, load "
            "fsdp.state_dict() into a freshly built model"
        )

    # -- gathering ---------------------------------------------------------------------------

    def _reduced_parameters(self, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
        return [p for p in trainable if not is_sharded(p)]

    def _synchronize(self) -> None:
        # the replicated parameters: few and small
        all_reduce_flat(
            self.local_gradients(), self.used_everywhere, self.process_group, self.world_size
        )

    def _cast_inputs(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A forward pre-hook of each layer that runs in ``compute_dtype``: its floating inputs
        cast to it."""
        return tree_map(self._cast_input, (args, kwargs))

    def _cast_input(self, value: object) -> object:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(self.compute_dtype)
        return value

    def _gather(self, uses: list[_Use]) -> None:
        """Start gathering ``uses``' full weights: one all-gather per dtype among them."""
        by_dtype: dict[torch.dtype, list[_Use]] = {}
        for use in uses:
            dtype = self.compute_dtype or use.shard.param.dtype
            by_dtype.setdefault(dtype, []).append(use)
        for dtype, same in by_dtype.items():
            gather = Gather([u.shard for u in same], dtype, self.process_group, self.world_size)
            gathering = _Gathering(gather, same)
            for use in same:
                use.full, use.gather = None, gathering

    def _ready(self, use: _Use) -> torch.Tensor:
        """``use``'s full weight, once its all-gather is done (which makes the full weights of
        every use gathered with it)."""
        gathering = use.gather
        if gathering is not None:
            fulls = gathering.gather.wait()
            for other, full in zip(gathering.uses, fulls, strict=True):
                if other.gather is gathering:  # (not gathered again since)
                    other.full, other.gather = full, None
        assert use.full is not None  # (gathered, or waited for just now)
        return use.full

    def _gather_full(self, param: nn.Parameter) -> torch.Tensor:
        shard = self._shards.get(param)
        if shard is None:
            return param.detach().clone()
        return shard.gather_full(self.process_group)

    def _enter(self, unit: int) -> None:
        """One of ``unit``'s modules is about to run."""
        recorded = self._active.get(unit)
        if recorded is None:
            self._before(unit)
        elif not recorded[1] and torch.is_grad_enabled():
            # Made full under no_grad (a reentrant checkpoint's forward), now run with grad:
            # connect the weights to autograd.
            self._install(unit, recorded[0])

    def _leave(self, unit: int) -> None:
        self._running.discard(unit)
        self._after(unit)

    def _before(self, unit: int) -> None:
        if _in_backward():
            # Recomputing in backward: a unit an earlier recomputation left full (part of a
            # block recomputed outside the block's forward, whose hook never ran; frozen
            # weights get no gradient to release them) is done with: autograd keeps what it
            # saved of it. A unit whose module is still running keeps its weights.
            for other in [u for u in self._active if u != unit and u not in self._running]:
                self._after(other)
        uses: list[_Use] = []
        if self._sharded_of[unit]:
            prefetched = self._prefetched.pop(unit, None)
            uses = prefetched if prefetched is not None else self._start_unit(unit)
            self._note_order(unit)
            for use in uses:
                full = self._ready(use)
                last = self._last_use  # backward gathers the block before while this one runs
                use.previous = (
                    last if last is None or last.cohort is not use.cohort else last.previous
                )
                self._last_use = use
                if full.numel():  # (an empty one's address is 0, as a meta tensor's)
                    self._live[full.untyped_storage().data_ptr()] = use
        self._install(unit, uses)

    def _install(self, unit: int, uses: list[_Use]) -> None:
        """Point the unit's attributes at the full weights (through one autograd node when
        gradients are recorded) and at the replicated parameters cast for compute."""
        recording = torch.is_grad_enabled()
        self._active[unit] = (uses, recording)
        sharded = self._sharded_of[unit]
        fulls = [use.full for use in uses]
        trainable = [i for i, (_, _, param) in enumerate(sharded) if param.requires_grad]
        if recording and trainable:
            outputs = _GatheredWeights.apply(
                self, [uses[i] for i in trainable], *(sharded[i][2] for i in trainable)
            )
            for i, full in zip(trainable, outputs, strict=True):
                fulls[i] = full
        for (owner, name, _), full in zip(sharded, fulls, strict=True):
            owner.__dict__[name] = full
        _, attributes = self._units[unit]
        if len(sharded) < len(attributes):  # replicated parameters, cast for compute
            for owner, name, param in attributes:
                if param not in self._shards:
                    owner.__dict__[name] = param.to(self.compute_dtype)

    def _after(self, unit: int) -> None:
        """Drop the unit's full weights: freed now, or when autograd no longer needs them."""
        _, attributes = self._units[unit]
        for owner, name, _ in attributes:
            owner.__dict__.pop(name, None)
        uses, _ = self._active.pop(unit, ((), False))
        for use in uses:
            if use.full is not None:
                self._live.pop(use.full.untyped_storage().data_ptr(), None)
            use.full = None  # if autograd saved it, backward gathers it again

    def _start_unit(self, unit: int) -> list[_Use]:
        """Gather ``unit``'s weights with those of the other units of its block that are not
        gathered already (they wait in ``_prefetched``); returns ``unit``'s uses."""
        group = self._group_of[unit]
        later = None  # recomputing in backward: only units from this one on whose backward is
        # still to come will run
        if _in_backward() and unit in self._order:
            later = set(self._order[self._order.index(unit) :])
        members = [
            u
            for u in self._group_units[group]
            if u == unit
            or (
                u not in self._prefetched
                and u not in self._active
                and (later is None or (u in later and u not in self._finished))
            )
        ]
        uses_of = {
            u: [_Use(self._shards[p], u) for _, _, p in self._sharded_of[u]] for u in members
        }
        every = [use for uses in uses_of.values() for use in uses]
        self._gather(every)
        grads = sum(use.cohort_grads for use in every)
        for use in every:
            use.cohort, use.cohort_grads = every, grads
        for u in members:
            if u != unit:
                self._prefetched[u] = uses_of[u]
        return uses_of[unit]

    def _regather(self, use: _Use) -> None:
        """In backward: gather ``use`` again with every weight gathered with it in forward that
        backward still needs (saved by autograd, not gathered)."""
        wanted = [u for u in use.cohort if u.saved and u.full is None and u.gather is None]
        if use not in wanted:
            wanted.append(use)
        self._gather(wanted)

    def _note_order(self, unit: int) -> None:
        """Record the forward's order of sharded units and prefetch the next one."""
        if _in_backward():
            # Recomputing a checkpointed segment inside backward: its units run in forward
            # order, so prefetch the next one, unless backward has already passed it.
            position = self._order.index(unit) if unit in self._order else len(self._order)
            following = self._order[position + 1] if position + 1 < len(self._order) else None
            if following is not None and following not in self._finished | self._prefetched.keys():
                self._prefetched[following] = self._start_unit(following)
            return
        position = self._position
        self._position += 1
        if position < len(self._order) and self._order[position] == unit:
            following = self._next_block_unit(position)
            if following is not None and following not in self._prefetched:
                self._prefetched[following] = self._start_unit(following)
        else:  # a new order (the first forward, or a different path): record it
            del self._order[position:]
            self._order.append(unit)

    def _next_block_unit(self, position: int) -> int | None:
        """The first unit after ``position`` in the forward's order that is gathered with
        another block: gathering it while this block runs hides the all-gather."""
        group = self._group_of[self._order[position]]
        for following in range(position + 1, len(self._order)):
            if self._group_of[self._order[following]] != group:
                return self._order[following]
        return None

    def _drop_prefetched(self) -> None:
        for uses in self._prefetched.values():
            for use in uses:
                self._ready(use)  # collectives must complete even if unused
                use.full = None
        self._prefetched.clear()
        for unit in list(self._active):
            self._after(unit)
        self._live.clear()
        self._running.clear()

    # -- what autograd saves ----------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _SavedWeight:
        if self._live:  # called for every tensor autograd saves: kept to one lookup
            try:
                use = self._live.get(tensor.untyped_storage().data_ptr())
            except (NotImplementedError, RuntimeError):  # sparse: no single storage
                return tensor
            if use is not None and use.full is not None:
                use.saved = True
                return _SavedWeight(use, tensor)
        return tensor

    def _unpack(self, saved: torch.Tensor | _SavedWeight) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        use = saved.use
        if use.full is None and use.gather is None:
            self._regather(use)
        previous = use.previous  # the next weight backward needs: gather it ahead
        if (
            previous is not None
            and previous.saved
            and previous.full is None
            and previous.gather is None
        ):
            self._regather(previous)
        full = self._ready(use)
        if not use.shard.param.requires_grad:
            # No gradient will arrive to release a frozen weight: autograd's node holds it only
            # while its backward runs. (Another node saving it gathers it again.)
            use.full, use.saved = None, False
        return full.as_strided(*saved.view)

    def _gradient_arrived(self, use: _Use, grad_full: torch.Tensor) -> None:
        """A full weight's gradient: free the full weight and queue the gradient; the weights
        gathered together (a block's) are reduce-scattered together, asynchronously."""
        self._finished.add(use.unit)
        if use.unit in self._active:
            # A recomputation of part of a block, outside the block's forward, never ran the
            # block's forward hook: release it here.
            self._after(use.unit)
        if use.full is not None:  # (a use of the forward, not of the recomputation)
            self._live.pop(use.full.untyped_storage().data_ptr(), None)
        use.full, use.saved = None, False
        if self._pending and self._pending[0][0].cohort is not use.cohort:
            self._reduce_pending()
        self._pending.append((use, grad_full))
        # Every weight of the block that can receive a gradient has: send now. (One that never
        # receives one leaves the group for the next block's first gradient, or the end, to send.)
        if len(self._pending) >= use.cohort_grads:
            self._reduce_pending()

    def _reduce_pending(self) -> None:
        """Reduce-scatter the queued full gradients: one collective per parameter dtype among
        them (one in all for a block of one dtype), so each slice comes back in its
        parameter's dtype."""
        pending, self._pending = self._pending, []
        by_dtype: dict[torch.dtype, list[tuple[Shard, torch.Tensor]]] = {}
        for use, grad in pending:
            by_dtype.setdefault(use.shard.param.dtype, []).append((use.shard, grad))
        for same in by_dtype.values():
            self._reduce_scatter(same)

    def _reduce_scatter(self, pending: list[tuple[Shard, torch.Tensor]]) -> None:
        """Reduce-scatter full gradients of parameters of one dtype in one collective."""
        reduce = ReduceScatter(pending, self.process_group, self.rank, self.world_size)
        if reduce.work is None:  # one rank: nothing in flight
            self._reduced.extend(reduce.wait())
            return
        self._reducing.append(reduce)
        if len(self._reducing) > IN_FLIGHT_REDUCE_SCATTERS:
            self._finish_oldest_reduce_scatter()

    def _finish_oldest_reduce_scatter(self) -> None:
        self._reduced.extend(self._reducing.popleft().wait())


def _blocks(module: nn.Module, owners: list[nn.Module], items_per_block: int = 1) -> list[int]:
    """A group number per owner: owners inside the same item of an ``nn.ModuleList`` (the
    innermost one: a Transformer's layer, or one expert of a list of experts inside it) share
    one, and so do the items ``i`` whose ``i // items_per_block`` is equal; any other owner is its
    own."""
    block_of: dict[int, object] = {}  # id(module) -> (id(its list), chunk), for modules inside one

    def visit(parent: nn.Module, block: object) -> None:
        is_list = isinstance(parent, nn.ModuleList)
        children = parent if isinstance(parent, nn.ModuleList) else parent.children()
        for index, child in enumerate(children):
            if id(child) in block_of:  # shared by two blocks: the first keeps it
                continue
            inner: object = (id(parent), index // items_per_block) if is_list else block
            if inner is not None:
                block_of[id(child)] = inner
            visit(child, inner)

    visit(module, None)
    numbers: dict[object, int] = {}
    return [
        numbers.setdefault(block_of.get(id(owner), ("alone", i)), len(numbers))
        for i, owner in enumerate(owners)
    ]


def runs_in_compute_dtype(layer: nn.Module) -> bool:
    """The mixed-precision rule: a layer that holds a weight of two or more dimensions (a
    matmul's, a lookup's, a stack of experts') computes in ``compute_dtype``; any other (a norm,
    whose gain is 1-D) keeps its parameters' dtype."""
    return any(p.dim() >= 2 for p in layer.parameters(recurse=False))


def _units(module: nn.Module, shards: dict, cast_layers: list[nn.Module]) -> list[_Unit]:
    """(unit module, [(owner, attribute, parameter)]) for the parameters FSDP handles: the
    sharded ones and every floating one of ``cast_layers``. An owner inside
    an item of an ``nn.ModuleList`` (the innermost one) belongs to that item's unit; the owners
    outside every list (embeddings, the final norm, the output layer) form the unit of the
    whole ``module``, full while its forward runs: a model may read them outside their own
    forward (a fused loss reads the output layer's weight)."""
    item_of: dict[int, nn.Module | None] = {}  # id(module) -> the list item around it

    def visit(parent: nn.Module, item: nn.Module | None) -> None:
        is_list = isinstance(parent, nn.ModuleList)
        for child in parent.children():
            if id(child) not in item_of:  # shared by two items: the first keeps it
                item_of[id(child)] = child if is_list else item
                visit(child, item_of[id(child)])

    visit(module, None)
    units: dict[int, _Unit] = {}
    cast_ids = {id(layer) for layer in cast_layers}
    for owner in module.modules():
        cast = id(owner) in cast_ids
        attributes = [
            (owner, name, p)
            for name, p in owner._parameters.items()
            if p is not None and (p in shards or (cast and p.is_floating_point()))
        ]
        if attributes:
            site = item_of.get(id(owner)) or module
            units.setdefault(id(site), (site, []))[1].extend(attributes)
    return list(units.values())
