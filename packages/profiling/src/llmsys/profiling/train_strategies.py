"""The data-parallel strategies of ``llmsys-bench train``: how each one wraps a Hugging Face Llama
and builds its AdamW, and how a model is prepared for them (activation checkpointing, each
decoder layer compiled).

========================  ===================================================================
``one-gpu``               each rank trains alone, no communication: the baseline
``ddp-bucketed``          ``llmsys.ddp.DDPBucketed`` (25 MB buckets, all-reduce overlapped)
``zero1``                 ``llmsys.sharded_optim.ShardedOptimizer`` over ``DDPBucketed``
``fsdp``                  ``llmsys.ddp.FSDP(compute_dtype=torch.bfloat16)``
``ddp``                   torch's ``DistributedDataParallel``
``zero``                  torch's ``ZeroRedundancyOptimizer`` over its DDP
``fsdp2``                 torch's ``fully_shard`` on each decoder layer, then the root, with
                          ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``
========================  ===================================================================

The replicating strategies (``one-gpu``, the DDPs, the ZeROs) train float32 weights under bf16
autocast; the sharding ones (``fsdp``, ``fsdp2``) without autocast, by their own mixed-precision
policies (ours keeps the norms' gains in float32, FSDP2 casts every parameter to bf16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from .training import ADAMW, make_optimizer


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a strategy trains and what the memory model calls it.

    Args:
        autocast: the forward runs under bf16 autocast (float32 weights).
        memory: the ``llmsys-roofline memory`` strategy that predicts its peak ("ddp", "zero1"
            or "fsdp").
        alone: each rank trains alone (no communication; the memory model's one device).
    """

    autocast: bool
    memory: str
    alone: bool = False


STRATEGIES = {
    "one-gpu": Strategy(autocast=True, memory="ddp", alone=True),
    "ddp-bucketed": Strategy(autocast=True, memory="ddp"),
    "zero1": Strategy(autocast=True, memory="zero1"),
    "fsdp": Strategy(autocast=False, memory="fsdp"),
    "ddp": Strategy(autocast=True, memory="ddp"),
    "zero": Strategy(autocast=True, memory="zero1"),
    "fsdp2": Strategy(autocast=False, memory="fsdp"),
}
CHECKPOINTING = ("none", "full")


@dataclasses.dataclass
class Trainer:
    """A wrapped model, its optimizer, and what must run between backward and the optimizer
    step (our wrappers' ``finish_gradient_synchronization``), if anything."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    finish: Callable[[], None] | None = None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``).

    Raises:
        ValueError: ``model`` has no ``model.layers`` list.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers` ModuleList of decoder layers"
        )
    return layers


def prepare(model: nn.Module, *, compile: bool, checkpointing: str) -> nn.Module:
    """``model`` with Hugging Face's non-reentrant activation checkpointing of every decoder
    layer (``checkpointing="full"``) and each decoder layer compiled (``compile``, in place,
    as torchtitan does), before any strategy wraps it.

    Raises:
        ValueError: ``checkpointing`` is not one of ``CHECKPOINTING``, or the model does not
            support gradient checkpointing.
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"`checkpointing` must be one of {CHECKPOINTING}, got {checkpointing!r}")
    if checkpointing == "full":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
        enable = cast(Callable[..., None], model.gradient_checkpointing_enable)
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile:
        for layer in decoder_layers(model):
            layer.compile()
    return model


def _adamw(device: torch.device) -> dict[str, Any]:
    """AdamW's options for an optimizer class taken by name (ZeRO's): ``ADAMW``, fused on CUDA."""
    return ADAMW | ({"fused": True} if device.type == "cuda" else {"foreach": True})


def _torch_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def _fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The mesh on the model's device: fully_shard's default is CUDA whenever a GPU exists.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def build(name: str, model: nn.Module, device: torch.device) -> Trainer:
    """``model`` (float32, on ``device``, prepared) wrapped by strategy ``name`` with its AdamW
    (``training.ADAMW``'s settings), in the process group already initialized.

    Raises:
        ValueError: ``name`` is not one of ``STRATEGIES``.
    """
    from llmsys.ddp import FSDP, DDPBucketed

    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; the strategies: {list(STRATEGIES)}")
    if name == "one-gpu":
        return Trainer(model, make_optimizer(model))
    if name in ("ddp-bucketed", "zero1"):
        ddp = DDPBucketed(model)
        finish = ddp.finish_gradient_synchronization
        if name == "ddp-bucketed":
            return Trainer(ddp, make_optimizer(ddp), finish)
        from llmsys.sharded_optim import ShardedOptimizer

        sharded = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, **_adamw(device))
        return Trainer(ddp, sharded, finish)
    if name == "fsdp":
        fsdp = FSDP(model, compute_dtype=torch.bfloat16)
        return Trainer(fsdp, make_optimizer(fsdp), fsdp.finish_gradient_synchronization)
    if name == "fsdp2":
        sharded_model = _fsdp2(model, device)
        return Trainer(sharded_model, make_optimizer(sharded_model))
    wrapped = _torch_ddp(model, device)
    if name == "ddp":
        return Trainer(wrapped, make_optimizer(wrapped))
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(
        list(wrapped.parameters()), optimizer_class=torch.optim.AdamW, **_adamw(device)
    )
    return Trainer(wrapped, zero)
