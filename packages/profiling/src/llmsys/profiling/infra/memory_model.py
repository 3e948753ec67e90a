"""Training memory per device, and when sharded training's communication hides behind compute.

What is counted, per device, in bytes:

- ``params``: the weights the forward runs on (``DtypePolicy.params``).
- ``grads``: one gradient per weight (``DtypePolicy.grads``).
- ``master``: an fp32 master copy when the working weights are lower precision (mixed
  precision); 0 when ``DtypePolicy.master`` is None (the weights *are* the master copy).
- ``optimizer``: ``DtypePolicy.optimizer_states`` per weight (AdamW: 2, the moments m and v).
- ``activations``: what the backward needs, per token and layer (see :class:`ModelShape`),
  times the tokens per device and the layers; with per-layer activation checkpointing, only
  each layer's input plus one layer's activations while it is recomputed.
- ``gathered``: ZeRO-3 / FSDP's unsharded copy of the layer being computed (weights and its
  gradient before the reduce-scatter), 0 for the other strategies.

``state`` is params + grads + master + optimizer (the model state); ``total`` adds activations
and gathered. The logits, the loss, temporary buffers and the allocator's fragmentation are
not counted.

Strategies over ``devices`` GPUs: "ddp" replicates everything; "zero1" shards the optimizer
state and master weights; "zero2" also the gradients; "zero3" and "fsdp" also the weights
(FSDP is ZeRO-3); "tp" (Megatron tensor parallelism, no sequence parallelism) shards every
weight and its state, and the activations inside a block, while the block's d_model-wide
activations stay replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ..config import ModelConfig
from . import collectives
from .hardware import HardwareSpec
from .roofline import MATMUL_PRECISION, dtype_bytes

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp")


@dataclasses.dataclass(frozen=True)
class DtypePolicy:
    """Element types of the training state.

    Args:
        params: working weights. Default "bf16".
        grads: gradients. Default "bf16".
        master: master weights, or None for no separate copy. Default "fp32".
        optimizer_state: optimizer moments. Default "fp32".
        optimizer_states: moments per weight (AdamW 2, SGD with momentum 1). Default 2.
        activations: saved activations. Default "bf16".
    """

    params: str = "bf16"
    grads: str = "bf16"
    master: str | None = "fp32"
    optimizer_state: str = "fp32"
    optimizer_states: int = 2
    activations: str = "bf16"

    def __post_init__(self) -> None:
        for field in ("params", "grads", "optimizer_state", "activations"):
            dtype_bytes(getattr(self, field))
        if self.master is not None:
            dtype_bytes(self.master)
        if isinstance(self.optimizer_states, bool) or self.optimizer_states not in range(0, 9):
            raise ValueError(
                f"DtypePolicy: `optimizer_states` must be an int in 0..8, "
                f"got {self.optimizer_states!r}"
            )


# fp32 weights (the master copy), fp32 gradients and AdamW moments, bf16 activations
FP32_ADAMW = DtypePolicy(params="fp32", grads="fp32", master=None, optimizer_state="fp32")
# bf16 weights and gradients, an fp32 master copy and fp32 AdamW moments
MIXED_ADAMW = DtypePolicy()
POLICIES = {"fp32-adamw": FP32_ADAMW, "mixed-adamw": MIXED_ADAMW}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a network.

    Args:
        name: a label.
        num_layers: repeated blocks.
        params_per_layer: weights in one block.
        other_params: weights outside the blocks (embeddings, final norm, output layer).
        d_model: the residual width.
        activations_replicated: saved activation elements per token and block that tensor
            parallelism does not shard (d_model-wide).
        activations_sharded: saved activation elements per token and block that it shards.
        tp_all_reduces: all-reduces of a (tokens, d_model) activation per block and pass under
            tensor parallelism (2 for attention + FFN, 1 for an FFN alone).
    """

    name: str
    num_layers: int
    params_per_layer: int
    other_params: int
    d_model: int
    activations_replicated: int
    activations_sharded: int
    tp_all_reduces: int

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "name":
                if not isinstance(value, str):
                    raise ValueError(f"ModelShape: `name` must be a str, got {value!r}")
                continue
            minimum = 1 if field.name in ("num_layers", "d_model") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"ModelShape: `{field.name}` must be an int >= {minimum}, got {value!r}"
                )

    @property
    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.other_params

    @property
    def activations_per_token_layer(self) -> int:
        return self.activations_replicated + self.activations_sharded


def ffn_only(d_model: int, d_ff: int, num_layers: int) -> ModelShape:
    """A stack of ``num_layers`` FFN blocks ``y = x + W_down act(W_up x)``.

    Weights per block: ``W_up`` (d_ff x d_model) and ``W_down`` (d_model x d_ff), no biases or
    norms: ``2 d_model d_ff``. Saved per token and block: x (d_model, W_up's input), the
    pre-activation (d_ff, for act's backward) and act's output (d_ff, W_down's input).
    """
    for name, value in (("d_model", d_model), ("d_ff", d_ff), ("num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"ffn_only: `{name}` must be a positive int, got {value!r}")
    return ModelShape(
        name=f"ffn d_model={d_model} d_ff={d_ff} layers={num_layers}",
        num_layers=num_layers,
        params_per_layer=2 * d_model * d_ff,
        other_params=0,
        d_model=d_model,
        activations_replicated=d_model,
        activations_sharded=2 * d_ff,
        tp_all_reduces=1,
    )


def from_config(config: ModelConfig) -> ModelShape:
    """The Transformer LM of ``config`` (``llmsys.profiling.TransformerLM``, dense SwiGLU FFN;
    an MoE config counts all its experts' weights and ``topk`` experts' activations).

    Weights per block: q, k, v, o (``4 d^2``), SwiGLU's w1, w3, w2 (``3 d d_ff`` per expert)
    and two RMSNorm gains; outside: the embedding, the final norm and the untied output
    layer. Saved per token and block, with a fused attention (no T x T scores kept): the two
    norms' inputs and outputs (4 d), q, k, v and the attention output (4 d, sharded by TP),
    and w1's, w3's and the gate's outputs (3 d_ff per active expert, sharded).
    """
    d, d_ff = config.d_model, config.d_ff
    experts = config.num_experts if config.ffn == "moe" else 1
    active = config.topk if config.ffn == "moe" else 1
    router = d * config.num_experts if config.ffn == "moe" else 0
    return ModelShape(
        name=f"transformer d_model={d} d_ff={d_ff} layers={config.num_layers}",
        num_layers=config.num_layers,
        params_per_layer=4 * d * d + 3 * d * d_ff * experts + router + 2 * d,
        other_params=2 * config.vocab_size * d + d,
        d_model=d,
        activations_replicated=4 * d,
        activations_sharded=4 * d + 3 * d_ff * active,
        tp_all_reduces=2,
    )


def from_llama(sizes: Mapping[str, Any]) -> ModelShape:
    """A Hugging Face Llama of ``sizes`` (its ``LlamaConfig`` fields: ``hidden_size``,
    ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``vocab_size``, ``tie_word_embeddings``): :func:`from_config`'s
    Transformer with grouped-query attention (k and v ``num_key_value_heads`` heads wide) and
    the output layer tied to the embedding or not.

    Raises:
        KeyError: ``sizes`` lacks one of those fields.
    """
    d, d_ff = sizes["hidden_size"], sizes["intermediate_size"]
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    kv = 2 * d // heads * kv_heads  # k and v widths together
    tied = bool(sizes.get("tie_word_embeddings", False))
    return ModelShape(
        name=f"llama hidden={d} intermediate={d_ff} layers={sizes['num_hidden_layers']}",
        num_layers=sizes["num_hidden_layers"],
        params_per_layer=2 * d * d + d * kv + 3 * d * d_ff + 2 * d,
        other_params=(1 if tied else 2) * sizes["vocab_size"] * d + d,
        d_model=d,
        activations_replicated=4 * d,
        activations_sharded=2 * d + kv + 3 * d_ff,
        tp_all_reduces=2,
    )


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device of each part (see the module docstring)."""

    params: float
    grads: float
    master: float
    optimizer: float
    activations: float
    gathered: float

    @property
    def state(self) -> float:
        """Model state: params + grads + master + optimizer, bytes."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        """Everything counted: state + activations + gathered, bytes."""
        return self.state + self.activations + self.gathered


def training_memory(
    shape: ModelShape,
    policy: DtypePolicy = MIXED_ADAMW,
    strategy: str = "ddp",
    devices: int = 1,
    *,
    tokens_per_device: int = 0,
    checkpointing: bool = False,
) -> MemoryEstimate:
    """Bytes per device to train ``shape``.

    Args:
        shape: the network (:func:`ffn_only`, :func:`from_config`).
        policy: element types. Default :data:`MIXED_ADAMW`.
        strategy: one of ``STRATEGIES``. Default "ddp".
        devices: GPUs the strategy spreads over. Default 1.
        tokens_per_device: tokens in one micro-batch on a device (batch x sequence length;
            under TP every rank of the group sees the same tokens). Default 0: no activations.
        checkpointing: per-layer activation checkpointing. Default False.
    """
    if strategy not in STRATEGIES:
        raise ValueError(
            f"training_memory: `strategy` must be one of {STRATEGIES}, got {strategy!r}"
        )
    for name, value in (("devices", devices), ("tokens_per_device", tokens_per_device)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name == "devices"):
            raise ValueError(f"training_memory: `{name}` must be an int >= 1 (devices) or >= 0, "
                             f"got {value!r}")  # fmt: skip
    n, count = devices, shape.num_params

    def part(dtype: str | None, copies: int, sharded: bool) -> float:
        if dtype is None:
            return 0.0
        return count * copies * dtype_bytes(dtype) / (n if sharded else 1)

    shards = {
        "params": strategy in ("zero3", "fsdp", "tp"),
        "grads": strategy in ("zero2", "zero3", "fsdp", "tp"),
        "state": strategy != "ddp",
    }
    tp = n if strategy == "tp" else 1
    per_layer = (shape.activations_replicated + shape.activations_sharded / tp) * dtype_bytes(
        policy.activations
    )
    if checkpointing:
        kept = shape.num_layers * shape.d_model * dtype_bytes(policy.activations) + per_layer
    else:
        kept = shape.num_layers * per_layer
    gathered = 0.0
    if strategy in ("zero3", "fsdp") and n > 1:
        layer = shape.params_per_layer
        gathered = layer * (dtype_bytes(policy.params) + dtype_bytes(policy.grads))
    return MemoryEstimate(
        params=part(policy.params, 1, shards["params"]),
        grads=part(policy.grads, 1, shards["grads"]),
        master=part(policy.master, 1, shards["state"]),
        optimizer=part(policy.optimizer_state, policy.optimizer_states, shards["state"]),
        activations=tokens_per_device * kept,
        gathered=gathered,
    )


def training_peak(
    shape: ModelShape,
    strategy: str = "ddp",
    devices: int = 1,
    *,
    tokens_per_device: int = 0,
    checkpointing: bool = False,
    compute: str = "bf16",
) -> float:
    """Bytes per device to train ``shape`` with float32 weights, gradients and AdamW moments
    (sharded as ``strategy`` shards them over ``devices``), activations and, under ZeRO-3 /
    FSDP, one gathered layer's weights and gradients in the ``compute`` dtype ("bf16" or
    "fp32"): mixed precision by autocast or by a sharding wrapper's compute dtype.

    Raises:
        ValueError: as :func:`training_memory`, or ``compute`` is not "bf16" or "fp32".
    """
    if compute not in ("bf16", "fp32"):
        raise ValueError(f"training_peak: `compute` must be 'bf16' or 'fp32', got {compute!r}")
    policy = dataclasses.replace(FP32_ADAMW, activations=compute)
    estimate = training_memory(
        shape, policy, strategy, devices,
        tokens_per_device=tokens_per_device, checkpointing=checkpointing,
    )  # fmt: skip
    gathered = estimate.gathered / 2 if compute == "bf16" else estimate.gathered
    return estimate.total - estimate.gathered + gathered


def min_devices(
    shape: ModelShape,
    budget_bytes: float,
    policy: DtypePolicy = MIXED_ADAMW,
    strategy: str = "fsdp",
    *,
    tokens_per_device: int = 0,
    checkpointing: bool = False,
    include: str = "state",
    max_devices: int = 1 << 16,
) -> int | None:
    """The smallest device count whose per-device bytes fit in ``budget_bytes``, or None
    when no count up to ``max_devices`` does (DDP never shards, so it fits on 1 or never).

    Args:
        shape, policy, strategy, tokens_per_device, checkpointing: as for
            :func:`training_memory`.
        budget_bytes: bytes available per device.
        include: "state" (weights, gradients, master, optimizer) or "total" (also
            activations and FSDP's gathered layer). Default "state".
        max_devices: the largest count tried. Default 65536.
    """
    if include not in ("state", "total"):
        raise ValueError(f"min_devices: `include` must be 'state' or 'total', got {include!r}")
    if not budget_bytes > 0:
        raise ValueError(f"min_devices: `budget_bytes` must be positive, got {budget_bytes!r}")

    def fits(n: int) -> bool:
        estimate = training_memory(
            shape, policy, strategy, n, tokens_per_device=tokens_per_device,
            checkpointing=checkpointing,
        )  # fmt: skip
        return getattr(estimate, include) <= budget_bytes

    if not fits(max_devices):
        return None
    low, high = 1, max_devices  # per-device bytes never grow with more devices: bisect
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid + 1, high)
    return low


def hiding_tokens(
    shape: ModelShape,
    hw: HardwareSpec,
    strategy: str,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    policy: DtypePolicy = MIXED_ADAMW,
) -> float | None:
    """Tokens per device (batch x sequence) from which one block's communication takes no
    longer than its forward + backward compute, so that it can hide behind it; None if
    it never does.

    Compute per block is ``6 x tokens x params_per_layer`` FLOPs (``/ tp`` under TP) at the
    matmul peak of ``policy.params``; attention's T^2 term is left out. Communication per block:
    FSDP / ZeRO-3 all-gathers the weights in the forward and again in the backward and
    reduce-scatters the gradients (independent of the batch); TP all-reduces a (tokens,
    d_model) activation ``tp_all_reduces`` times in the forward and as often in the backward
    (proportional to the batch, so TP hides from a batch on or never).

    Args:
        shape: the network.
        hw: the GPU and its links.
        strategy: "fsdp", "zero3" or "tp" (over all ``nodes * gpus_per_node`` GPUs).
        gpus_per_node, nodes: the layout (hierarchical collectives across nodes).
        policy: element types (weights and gradients travel in theirs, TP's activations in
            ``policy.activations``). Default :data:`MIXED_ADAMW`.
    """
    if strategy not in ("fsdp", "zero3", "tp"):
        raise ValueError(
            f"hiding_tokens: `strategy` must be 'fsdp', 'zero3' or 'tp', got {strategy!r}"
        )
    n = gpus_per_node * nodes
    layout: dict[str, Any] = dict(gpus_per_node=gpus_per_node, nodes=nodes)
    peak = hw.peak(MATMUL_PRECISION.get(policy.params, "bf16"))
    if strategy == "tp":
        flops_per_token = 6 * shape.params_per_layer / n

        def comm(tokens: float) -> float:
            nbytes = tokens * shape.d_model * dtype_bytes(policy.activations)
            one = collectives.collective_time("all-reduce", nbytes, hw, **layout)
            return 2 * shape.tp_all_reduces * one
    else:
        flops_per_token = 6 * shape.params_per_layer
        weights = shape.params_per_layer * dtype_bytes(policy.params)
        grads = shape.params_per_layer * dtype_bytes(policy.grads)

        def comm(tokens: float) -> float:
            gather = collectives.collective_time("all-gather", weights, hw, **layout)
            return 2 * gather + collectives.collective_time("reduce-scatter", grads, hw, **layout)

    # comm(tokens) = fixed + per_token * tokens under the alpha-beta model
    fixed, per_token = comm(0.0), comm(1.0) - comm(0.0)
    compute_per_token = flops_per_token / peak
    if compute_per_token <= per_token:
        return None if fixed > 0 or per_token > compute_per_token else 0.0
    return fixed / (compute_per_token - per_token)


def fmt_bytes(nbytes: float) -> str:
    """``12.3 GB`` (decimal units)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes:.4g} B" if not math.isnan(nbytes) else "nan"
