"""What every data-parallel wrapper shares: one model on every rank, and which gradients exist.

Data parallelism keeps a full copy of the model on each rank, gives each rank a different slice of
the batch, and averages the gradients before the optimizer steps, so every copy takes the same
step that one process would take on the whole batch. The wrappers differ only in *how* they
average (see ``wrappers.py``); this base class holds the contract they all keep:

- construction checks that every rank holds the same model (names, shapes, dtypes), then
  broadcasts every parameter and buffer from rank 0, so all copies start equal;
- a hook on each trainable parameter records that its gradient arrived (after autograd has
  accumulated it into ``.grad``), which is how the wrappers tell used parameters from unused ones;
- every rank reduces every trainable parameter's gradient (zeros where it has none), so the
  ranks' collectives always match and nothing hangs; then ``finish_gradient_synchronization()``
  asks which parameters got gradients since the last synchronization. Parameters no rank used
  keep their ``.grad`` as it was (as in single-process training); when ranks disagree, the
  error names the parameters and ranks,
  because averaging gradients that exist on some ranks only is almost always a bug in the
  training loop (torch DDP reports the same situation as a hang or "Expected to have finished
  reduction in the prior iteration");
- ``no_sync()`` lets gradients accumulate locally over micro-batches; the synchronization after
  the last one covers every parameter used in any of them.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .process_group import global_rank, rank_and_world_size

# The wrapper whose hooks are on each module now: a second wrapper on the same module would add
# its own hooks, and both would reduce every gradient. Each value is the wrapper's class name and
# a weak reference to it (None for FSDP, which shards the module in place for good): a value that
# held the wrapper, which holds the module, would keep both alive forever.
_WRAPPED: weakref.WeakKeyDictionary[nn.Module, tuple[str, weakref.ref | None]] = (
    weakref.WeakKeyDictionary()
)


def _wrapper_of(module: nn.Module) -> str | None:
    """The class name of the live wrapper on ``module`` (or of FSDP, forever), else None."""
    name, wrapper = _WRAPPED.get(module, (None, None))
    return name if name is not None and (wrapper is None or wrapper() is not None) else None


class DataParallelBase(nn.Module):
    """Base of the wrappers: broadcast at construction, gradient bookkeeping, ``no_sync``.

    Args:
        module: the model; it stays reachable as ``.module`` and ``forward`` runs it.
        process_group: the ranks that share the work (default: the whole world). Without an
            initialized process group (a plain ``python`` run) the wrapper is one rank of one.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``process_group`` not a process group.
        ValueError: ``module`` is already wrapped (``remove_hooks()`` first), its parameters
            are on more than one device, this process is not in ``process_group``, or the
            ranks' models differ.
    """

    def __init__(self, module: nn.Module, *, process_group: dist.ProcessGroup | None = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        holder = _wrapper_of(module)
        if holder is not None:
            raise ValueError(
                f"module is already wrapped by a {holder}, whose hooks "
                "would reduce every gradient a second time; call remove_hooks() on that wrapper "
                "first"
            )
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise ValueError(
                "module must have all its parameters on one device, got "
                f"{sorted(map(str, devices))}"
            )
        self.module = module
        self.process_group = process_group
        self.rank, self.world_size = rank_and_world_size(process_group)
        names: dict[torch.Tensor, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(param, []).append(name)
        # Unique tensors in registration order: a tied weight is one entry, reduced once.
        trainable = [p for p in module.parameters() if p.requires_grad]
        # Parameters frozen now have no hook: the only ones to check each step for having been
        # unfrozen since (walking every parameter each step cost milliseconds on an xl model).
        self._frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
        self.params = self._reduced_parameters(trainable)
        self.param_names = [" = ".join(names[p]) for p in self.params]
        self._used = [False] * len(self.params)  # got a gradient since the last synchronization
        self._arrived = [False] * len(self.params)  # ... in this synchronized backward
        self._syncing = True
        self._unchecked: tuple | None = None  # the last step's flags, when not checked then
        self._hooks = []
        if self.world_size > 1:
            _check_same_model(module, process_group, self.world_size)
            _broadcast_from_first_rank(module, process_group)
            self._hooks = [
                param.register_post_accumulate_grad_hook(_hook_to(self, i))
                for i, param in enumerate(self.params)
            ]
            self._claim_module(for_good=False)

    def remove_hooks(self) -> None:
        """Detach this wrapper from the module (to wrap it again, say, with another strategy)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        _, wrapper = _WRAPPED.get(self.module, (None, None))
        if wrapper is not None and wrapper() is self:
            del _WRAPPED[self.module]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient holds its mean over the ranks.

        Call it after ``backward()`` and before ``optimizer.step()``. Inside ``no_sync()`` it
        does nothing. Ranks disagreeing about which parameters got gradients is an error that
        names the parameters (raised in this call on a rank that lacked one, in the next call
        or ``on_train_batch_start()`` on the others); after it the replicas differ and training
        cannot go on.
        """
        if self.world_size == 1 or not self._syncing:
            return
        self._check_unchecked()
        self._check_all_parameters_known()
        try:
            self._synchronize()
        finally:
            self._reset()

    def on_train_batch_start(self) -> None:
        """Optional: check the last step's agreement and forget this step's bookkeeping."""
        self._check_unchecked()
        self._reset()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside; synchronize after the last micro-batch."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    # -- for the wrappers -------------------------------------------------------------------

    def _reduced_parameters(self, trainable: list[nn.Parameter]) -> list[nn.Parameter]:
        """The trainable parameters whose gradients are all-reduced (all of them, here)."""
        return trainable

    def _synchronize(self) -> None:
        raise NotImplementedError

    def _gradient_ready(self, index: int) -> None:
        """Called when parameter ``index``'s gradient is complete in a synchronized backward."""

    def _reset(self) -> None:
        self._used = [False] * len(self.params)
        self._arrived = [False] * len(self.params)

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        self._used[index] = True
        if not self._syncing:
            return
        if self._arrived[index]:
            raise RuntimeError(
                f"{type(self).__name__}: parameter {self.param_names[index]!r} received a second "
                "gradient before finish_gradient_synchronization(). Call it after every "
                "synchronized backward, run every backward but the last of a step under "
                "no_sync(), and use non-reentrant activation checkpointing (use_reentrant=False) "
                "for a parameter used in several checkpointed segments."
            )
        self._arrived[index] = True
        self._gradient_ready(index)

    def _claim_module(self, *, for_good: bool) -> None:
        """Mark ``self.module`` as wrapped by this wrapper (for good: even after it is gone)."""
        _WRAPPED[self.module] = (type(self).__name__, None if for_good else weakref.ref(self))

    def local_gradients(self) -> list[torch.Tensor]:
        """Each trainable parameter's gradient, or zeros where it got none since the last
        synchronization: every rank then reduces the same tensors, used here or not."""
        return [
            cast(torch.Tensor, p.grad) if used else torch.zeros_like(p)  # used: it has a grad
            for p, used in zip(self.params, self._used, strict=True)
        ]

    def used_everywhere(self) -> list[bool]:
        """Which parameters got a gradient since the last synchronization, on every rank.

        Every rank all-gathers one flag per parameter, but only a rank with a parameter that got
        no gradient waits for the answer now: it must learn whether any other rank used it. A
        rank whose every parameter got one knows the answer (all used) and checks the gathered
        flags at its next call, when they arrived long ago. So the usual step, every parameter
        used, makes the host wait for nothing: in a training loop whose host time is close to
        its GPU time (an eager model of 2B parameters at batch 4 x 512 on an H200) that wait was
        measured to cost more than all the communication launches together.
        """
        if not self.params:
            return []
        device = self.params[0].device
        flags = torch.tensor(self._used, dtype=torch.uint8)
        if device.type == "cuda":  # from pinned memory the copy does not wait for the stream
            flags = flags.pin_memory().to(device, non_blocking=True)
        everyone = [torch.empty_like(flags, device=device) for _ in range(self.world_size)]
        dist.all_gather(everyone, flags, group=self.process_group)
        per_rank = torch.stack(everyone)  # (world_size, parameters)
        if all(self._used):
            arrived = None
            if device.type == "cuda":  # to host memory without waiting; checked next call
                host = torch.empty(per_rank.shape, dtype=per_rank.dtype, pin_memory=True)
                per_rank = host.copy_(per_rank, non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record()
            self._unchecked = (per_rank, arrived)
            return self._used
        return self._agreed(per_rank.cpu())

    def _check_unchecked(self) -> None:
        if self._unchecked is not None:
            per_rank, arrived = self._unchecked
            self._unchecked = None
            if arrived is not None:
                arrived.synchronize()
            self._agreed(per_rank)

    def _agreed(self, per_rank: torch.Tensor) -> list[bool]:
        """Which parameters any rank used, from every rank's flags; raises if ranks disagree."""
        counts = per_rank.sum(0).tolist()
        disagreements = [
            f"  {self.param_names[i]!r}: gradient on ranks "
            f"{per_rank[:, i].nonzero().flatten().tolist()}, none on ranks "
            f"{(per_rank[:, i] == 0).nonzero().flatten().tolist()}"
            for i, count in enumerate(counts)
            if 0 < count < self.world_size
        ]
        if disagreements:
            raise RuntimeError(
                f"{type(self).__name__}: ranks disagree about which parameters received "
                "gradients since the last synchronization, so their mean is not defined:\n"
                + "\n".join(disagreements)
                + "\nEvery rank must use the same parameters in a step (check data-dependent "
                "branches and which losses are summed). The replicas now differ: restart from "
                "a checkpoint."
            )
        return [count > 0 for count in counts]

    def _check_all_parameters_known(self) -> None:
        """A parameter unfrozen after construction has no hook and would never be averaged."""
        unknown = [name for name, p in self._frozen if p.requires_grad and p.grad is not None]
        if unknown:
            raise RuntimeError(
                f"{type(self).__name__}: parameters {unknown} have gradients but did not require "
                "them when the wrapper was built, so they would not be averaged; wrap the module "
                "after unfreezing (remove_hooks() on this wrapper, then a new one)"
            )


def _hook_to(wrapper: DataParallelBase, index: int) -> Callable[[torch.Tensor], None]:
    """A gradient hook that calls ``wrapper._on_gradient(index, param)`` while the wrapper lives.

    It holds the wrapper weakly: a tensor's hooks live where the garbage collector cannot follow
    them, so a strong reference (the wrapper holds the module, which holds the parameters) would
    make a cycle that is never freed."""
    wrapper_ref = weakref.ref(wrapper)

    def hook(param: torch.Tensor) -> None:
        live = wrapper_ref()
        if live is not None:
            live._on_gradient(index, param)

    return hook


def _check_same_model(module: nn.Module, group: dist.ProcessGroup | None, world_size: int) -> None:
    """Raise on every rank if any rank's parameters or buffers differ in name, shape or dtype.

    Collectives are matched by order and size, so different models would pair unrelated tensors:
    a hang or silent garbage instead of this error.
    """
    signature = [
        ("parameter", name, tuple(p.shape), str(p.dtype), p.requires_grad)
        for name, p in module.named_parameters()
    ] + [("buffer", name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers()]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, signature, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        mismatch = next(
            (
                f"{a} on rank 0 but {b} on rank {rank}"
                for a, b in zip(everyone[0], theirs, strict=False)
                if a != b
            ),
            f"{len(everyone[0])} parameters and buffers on rank 0 but {len(theirs)} on rank {rank}",
        )
        raise ValueError(f"every rank must wrap the same model; found {mismatch}")


def _broadcast_from_first_rank(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every parameter and buffer equal to rank 0's (its initialization wins)."""
    source = global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=source, group=group)


# The earlier name, kept for users (torch.nn.DataParallel is another class).
DataParallel = DataParallelBase
