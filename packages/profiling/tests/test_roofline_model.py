"""Collectives (alpha-beta) and the training-memory model, against hand-computed values."""

from __future__ import annotations

import math

import pytest

from llmsys.profiling.config import ModelConfig
from llmsys.profiling.infra import collectives, hardware, memory_model
from llmsys.profiling.infra.collectives import Link
from llmsys.profiling.infra.memory_model import FP32_ADAMW, MIXED_ADAMW

LINK = Link("test", latency=1e-6, bandwidth=100e9)
S = 1e9


@pytest.mark.parametrize(
    "collective, algorithm, expected",
    [
        ("all-reduce", "ring", 2 * 7 * 1e-6 + 2 * 7 / 8 * S / 100e9),
        ("all-gather", "ring", 7 * 1e-6 + 7 / 8 * S / 100e9),
        ("reduce-scatter", "ring", 7 * 1e-6 + 7 / 8 * S / 100e9),
        ("broadcast", "ring", 7 * 1e-6 + S / 100e9),
        ("all-reduce", "tree", 2 * 3 * 1e-6 + 2 * S / 100e9),
        ("all-gather", "tree", 3 * 1e-6 + 7 / 8 * S / 100e9),
        ("reduce-scatter", "tree", 3 * 1e-6 + 7 / 8 * S / 100e9),
        ("broadcast", "tree", 3 * (1e-6 + S / 100e9)),
    ],
)
def test_flat_collectives(collective, algorithm, expected):
    assert collectives.flat_time(collective, S, 8, LINK, algorithm) == pytest.approx(expected)


def test_one_rank_costs_nothing_and_bad_values_rejected():
    assert collectives.flat_time("all-reduce", S, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="collective"):
        collectives.flat_time("all-to-all", S, 2, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        collectives.flat_time("all-reduce", S, 2, LINK, "star")
    with pytest.raises(ValueError, match="ranks"):
        collectives.flat_time("all-reduce", S, 0, LINK)
    with pytest.raises(ValueError, match="nodes"):
        collectives.collective_time("all-reduce", S, hardware.lookup("H100"), gpus_per_node=8,
                                    nodes=0)  # fmt: skip


def test_hierarchical_all_reduce():
    h100 = hardware.lookup("H100")
    nv, net = collectives.intra_node_link(h100), collectives.network_link(h100)
    assert nv.bandwidth == pytest.approx(450e9)
    expected = (
        collectives.flat_time("reduce-scatter", S, 8, nv)
        + collectives.flat_time("all-reduce", S / 8, 4, net)
        + collectives.flat_time("all-gather", S, 8, nv)
    )
    got = collectives.collective_time("all-reduce", S, h100, gpus_per_node=8, nodes=4)
    assert got == pytest.approx(expected)
    one_node = collectives.collective_time("all-gather", S, h100, gpus_per_node=8)
    assert one_node == pytest.approx(7 * 5e-6 + 7 / 8 * S / 450e9)
    two = collectives.collective_time("all-gather", S, h100, gpus_per_node=8, nodes=2)
    assert two == pytest.approx(one_node + 1e-5 + 0.5 * S / 8 / 50e9)
    bcast = collectives.collective_time("broadcast", S, h100, gpus_per_node=2, nodes=2)
    assert bcast == pytest.approx(1e-5 + S / 50e9 + 5e-6 + S / 450e9)


def test_no_nvlink_uses_the_host_link():
    a10 = hardware.lookup("A10")
    assert collectives.intra_node_link(a10).bandwidth == pytest.approx(32e9)


def test_bus_bandwidth():
    assert collectives.bus_bandwidth("all-reduce", 1e9, 4, 0.01) == pytest.approx(150e9)
    assert collectives.bus_bandwidth("all-gather", 1e9, 4, 0.01) == pytest.approx(75e9)


# The FFN-only XXL config: d_model 16384, d_ff 53248, 126 blocks of W_up and W_down.
XXL = memory_model.ffn_only(16384, 53248, 126)
XXL_PARAMS = 126 * 2 * 16384 * 53248


def test_xxl_on_one_device():
    assert XXL.num_params == XXL_PARAMS == 219_848_638_464
    one = memory_model.training_memory(XXL, FP32_ADAMW, "ddp", 1)
    assert (one.params, one.grads, one.master) == (4 * XXL_PARAMS, 4 * XXL_PARAMS, 0)
    assert one.optimizer == 8 * XXL_PARAMS
    assert one.state == 16 * XXL_PARAMS == pytest.approx(3.5176e12, rel=1e-4)  # 3.52 TB
    # activations in bf16: x (d_model) + pre-activation and activation (2 d_ff) per token, block
    act = memory_model.training_memory(XXL, FP32_ADAMW, "ddp", 1, tokens_per_device=1)
    assert act.activations == 126 * (16384 + 2 * 53248) * 2


def test_xxl_fsdp_and_smallest_n():
    n = memory_model.min_devices(XXL, 95e9, FP32_ADAMW, "fsdp")
    assert n == 38 == math.ceil(16 * XXL_PARAMS / 95e9)
    at_38 = memory_model.training_memory(XXL, FP32_ADAMW, "fsdp", 38)
    assert at_38.state == pytest.approx(16 * XXL_PARAMS / 38)
    assert at_38.state < 95e9 < memory_model.training_memory(XXL, FP32_ADAMW, "fsdp", 37).state
    assert at_38.gathered == 2 * 16384 * 53248 * (4 + 4)  # one block's weights and gradient
    assert memory_model.min_devices(XXL, 95e9, FP32_ADAMW, "ddp") is None


def test_strategies_shard_what_they_should():
    shape = memory_model.ffn_only(8, 16, 2)  # 512 params
    p = shape.num_params

    def parts(strategy):
        e = memory_model.training_memory(shape, MIXED_ADAMW, strategy, 4)
        return e.params, e.grads, e.master, e.optimizer

    assert parts("ddp") == (2 * p, 2 * p, 4 * p, 8 * p)
    assert parts("zero1") == (2 * p, 2 * p, p, 2 * p)
    assert parts("zero2") == (2 * p, p / 2, p, 2 * p)
    assert parts("zero3") == parts("fsdp") == parts("tp") == (p / 2, p / 2, p, 2 * p)
    tp = memory_model.training_memory(shape, MIXED_ADAMW, "tp", 4, tokens_per_device=10)
    assert tp.activations == 10 * 2 * (8 + 2 * 16 / 4) * 2


def test_checkpointing_keeps_layer_inputs():
    shape = memory_model.ffn_only(8, 16, 5)
    kept = memory_model.training_memory(shape, tokens_per_device=3, checkpointing=True)
    assert kept.activations == 3 * (5 * 8 + (8 + 32)) * 2
    full = memory_model.training_memory(shape, tokens_per_device=3)
    assert full.activations == 3 * 5 * (8 + 32) * 2


def test_from_config_counts_the_model():
    from llmsys.profiling.model import TransformerLM, num_parameters

    config = ModelConfig.named("tiny")
    shape = memory_model.from_config(config)
    assert shape.num_params == num_parameters(TransformerLM(config))


def test_hiding_tokens():
    h100 = hardware.lookup("H100")
    layer = 2 * 1024 * 4096
    shape = memory_model.ffn_only(1024, 4096, 4)
    tokens = memory_model.hiding_tokens(shape, h100, "fsdp", gpus_per_node=8)
    comm = 2 * collectives.collective_time("all-gather", 2 * layer, h100, gpus_per_node=8)
    comm += collectives.collective_time("reduce-scatter", 2 * layer, h100, gpus_per_node=8)
    assert tokens == pytest.approx(comm / (6 * layer / 989.4e12))
    tp = memory_model.hiding_tokens(shape, h100, "tp", gpus_per_node=8)
    assert tp is None  # a small FFN's all-reduces cost more per token than its matmuls
    with pytest.raises(ValueError, match="strategy"):
        memory_model.hiding_tokens(shape, h100, "ddp", gpus_per_node=8)


def test_bad_memory_arguments():
    with pytest.raises(ValueError, match="strategy"):
        memory_model.training_memory(XXL, strategy="zero4")
    with pytest.raises(ValueError, match="devices"):
        memory_model.training_memory(XXL, devices=0)
    with pytest.raises(ValueError, match="d_ff"):
        memory_model.ffn_only(8, 0, 1)
    with pytest.raises(ValueError, match="dtype"):
        memory_model.DtypePolicy(params="fp64")
    with pytest.raises(ValueError, match="include"):
        memory_model.min_devices(XXL, 1e9, include="all")
