"""Checkpoints independent of the world size: the full optimizer state on one rank, and back.

A full state dict has the format of a plain optimizer's ``state_dict()`` over all parameters:

    {"state": {global index: {"step": ..., "exp_avg": ..., ...}},   # parameters with state only
     "param_groups": [{"lr": ..., ..., "params": [global indices]}, ...]}

so it loads into a ``ShardedOptimizer`` of any world size or into the plain optimizer class.

Gathering (:func:`gather_state`): the ranks first send the destination a small description of
their state (keys, shapes, dtypes; one ``gather_object``), then each tensor point to point. The
destination copies each tensor to CPU as it arrives, so its GPU holds one extra tensor at a
time, never a second copy of the whole state, and the other ranks send their own tensors
without packing them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .comm import collective_device, rank_and_world_size


class TensorSpec(NamedTuple):
    """What a receiver allocates for one state tensor it is about to receive."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def gather_state(owned: Mapping[int, Mapping[str, Any]], to: int) -> dict[int, dict] | None:
    """Every rank's per-parameter optimizer state, on CPU on rank ``to``. Call on every rank.

    Args:
        owned: this rank's state: global parameter index -> that parameter's state (tensors
            and plain values, e.g. ``{"step": tensor(3.), "exp_avg": ..., "exp_avg_sq": ...}``).
        to: the rank that receives everything.

    Returns:
        On rank ``to``: global index -> state, sorted by index, with every tensor copied to
        CPU (a snapshot: later steps do not change it). On the other ranks: None.
    """
    rank, world_size = rank_and_world_size()
    gathered = {i: _to_cpu(state) for i, state in owned.items()} if rank == to else {}
    if world_size > 1:
        descriptions = {i: _describe(state) for i, state in owned.items()}
        every_description: list | None = [None] * world_size if rank == to else None
        dist.gather_object(descriptions, every_description, dst=to)
        device = collective_device()
        if rank != to:
            for state in owned.values():
                _send_tensors(state, to, device)
        else:
            assert every_description is not None  # (the gathering rank's list)
            for src, theirs in enumerate(every_description):
                if src != to:
                    for i, description in theirs.items():
                        gathered[i] = _receive_tensors(description, src, device)
    return dict(sorted(gathered.items())) if rank == to else None


def _describe(state: Mapping[str, Any]) -> dict[str, Any]:
    """What the receiver needs to know of one parameter's state: each tensor's shape and dtype
    (the tensor follows), and the plain values themselves."""
    return {
        key: TensorSpec(tuple(value.shape), value.dtype)
        if isinstance(value, torch.Tensor)
        else value
        for key, value in state.items()
    }


def _to_cpu(state: Mapping[str, Any]) -> dict[str, Any]:
    return {
        key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
        for key, value in state.items()
    }


def _send_tensors(state: Mapping[str, Any], to: int, device: torch.device) -> None:
    for value in state.values():
        if isinstance(value, torch.Tensor):
            dist.send(value.detach().to(device).contiguous(), dst=to)


def _receive_tensors(
    description: Mapping[str, Any], src: int, device: torch.device
) -> dict[str, Any]:
    """One parameter's state from ``src``, each tensor moved to CPU as soon as it arrives."""
    state = {}
    for key, spec in description.items():
        if isinstance(spec, TensorSpec):
            buffer = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.recv(buffer, src=src)
            state[key] = buffer.cpu()
        else:
            state[key] = spec
    return state


def unpack_full_state_dict(
    state_dict: Any, group_sizes: list[int]
) -> tuple[dict[int, dict], list[dict]]:
    """Check a full state dict against this optimizer's param groups and read it.

    Parameters are matched by position, as ``torch.optim.Optimizer.load_state_dict`` does: the
    k-th id listed across the saved groups is the k-th parameter across the current groups.

    Args:
        state_dict: a full state dict (see the module docstring).
        group_sizes: the number of parameters in each current param group.

    Returns:
        (state by global index, each saved group's options without ``"params"``).

    Raises:
        TypeError, ValueError: naming what does not match.
    """
    where = "ShardedOptimizer.load_state_dict"
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise TypeError(
            f"{where}: `state_dict` must be a full optimizer state dict, a mapping with 'state' "
            f"and 'param_groups' (from consolidate_state_dict() then state_dict(), or a plain "
            f"optimizer's state_dict()), got {got}"
        )
    groups, state = state_dict["param_groups"], state_dict["state"]
    saved_sizes = [len(group["params"]) for group in groups]
    if saved_sizes != group_sizes:
        raise ValueError(
            f"{where}: `state_dict` must have param groups of the sizes this optimizer has, "
            f"{group_sizes} parameters, got {saved_sizes}"
        )
    ids = [i for group in groups for i in group["params"]]
    position = {saved_id: k for k, saved_id in enumerate(ids)}
    if len(position) != len(ids):
        raise ValueError(f"{where}: `state_dict` lists a parameter id twice in 'param_groups'")
    unknown = sorted(set(state) - position.keys(), key=str)
    if unknown:
        raise ValueError(
            f"{where}: `state_dict` has state for parameter ids {unknown} that no param group "
            f"lists (it was saved from another model or optimizer)"
        )
    by_index = {position[saved_id]: dict(values) for saved_id, values in state.items()}
    options = [{key: value for key, value in g.items() if key != "params"} for g in groups]
    return by_index, options
