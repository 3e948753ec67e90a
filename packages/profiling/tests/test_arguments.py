"""Issue 29: every config and entry point refuses what it cannot do, naming the argument, before
anything changes; for any input exactly one happens: a valid result or a ValueError/TypeError
that names the field."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmsys.profiling import ModelConfig, TransformerLM
from llmsys.profiling.infra.collectives import Link
from llmsys.profiling.infra.hardware import HardwareSpec
from llmsys.profiling.infra.memory_model import ModelShape
from llmsys.profiling.options import Variant

TINY = ModelConfig(
    vocab_size=101, context_length=16, d_model=24, d_ff=40, num_layers=2, num_heads=3
)
NAN, INF = float("nan"), float("inf")


# --- ModelConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["rope_theta", "norm_eps"])
@pytest.mark.parametrize("value", [0, 0.0, -1e4, -1e-5, NAN, INF, -INF, "1e4", None, True])
def test_rope_theta_and_norm_eps_must_be_finite_and_positive(field, value):
    with pytest.raises(ValueError, match=rf"`{field}` must be a finite number > 0, got"):
        TINY.replace(**{field: value})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"topk": 1.5}, "`topk` must be a positive int, got 1.5"),
        ({"num_experts": 0}, "`num_experts` must be a positive int, got 0"),
        ({"checkpoint": "yes"}, "`checkpoint` must be a bool, got 'yes'"),
        ({"vocab_size": 10.0}, "`vocab_size` must be a positive int, got 10.0"),
    ],
)
def test_other_fields_are_checked(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_valid_values_still_work():
    assert TINY.replace(rope_theta=500_000, norm_eps=1e-6).rope_theta == 500_000


FIELD_VALUES = st.one_of(
    st.integers(-2, 200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.sampled_from(["sdpa", "naive", "moe", "eager", "fused", "x"]),
)
FIELDS = [
    "vocab_size", "context_length", "d_model", "d_ff", "num_layers", "num_heads", "rope_theta",
    "norm_eps", "attention", "ffn", "num_experts", "topk", "checkpoint", "norm", "rope", "loss",
]  # fmt: skip


@settings(max_examples=50, deadline=None, database=None)
@given(changes=st.dictionaries(st.sampled_from(FIELDS), FIELD_VALUES, max_size=3))
def test_property_a_config_is_valid_or_names_a_field(changes):
    try:
        config = TINY.replace(**changes)
    except ValueError as error:
        assert any(f"`{name}`" in str(error) for name in FIELDS), error
        return
    assert math.isfinite(config.rope_theta) and config.rope_theta > 0
    assert math.isfinite(config.norm_eps) and config.norm_eps > 0
    for name in [*FIELDS[:6], "num_experts", "topk"]:
        value = getattr(config, name)
        assert type(value) is int and value >= 1, name
    assert config.d_model % config.num_heads == 0


# --- TransformerLM tokens ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (101, r"to 101; the first out of range is 101 at position \(1, 2\)"),
        (-1, r"got ids from -1 to \d+; the first out of range is -1 at position \(1, 2\)"),
        (10**6, r"to 1000000; the first out of range is 1000000 at position \(1, 2\)"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(bad, message):
    model = TransformerLM(TINY)
    tokens = torch.randint(0, 100, (2, 5))
    tokens[1, 2] = bad
    original = tokens.clone()
    expected = rf"TransformerLM: `tokens` must hold ids in \[0, vocab_size=101\), .*{message}"
    with pytest.raises(ValueError, match=expected):
        model(tokens)
    assert torch.equal(tokens, original)


def test_the_token_check_can_be_turned_off():
    model = TransformerLM(TINY, check_tokens=False)
    with pytest.raises(IndexError):  # what nn.Embedding says without the check
        model(torch.tensor([[0, 101]]))
    with pytest.raises(TypeError, match=r"`check_tokens` must be a bool, got int"):
        TransformerLM(TINY, check_tokens=1)


def test_empty_and_boundary_tokens_pass():
    model = TransformerLM(TINY)
    assert model(torch.tensor([[0, 100]])).shape == (1, 2, 101)
    assert model(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 101)


def test_the_token_check_stays_out_of_compiled_graphs():
    """Under torch.compile the check is skipped (it would need the values on the host): the
    whole forward still compiles into one graph."""
    model = TransformerLM(TINY)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    tokens = torch.randint(0, 101, (2, 5))
    torch.testing.assert_close(compiled(tokens), model(tokens))


@pytest.mark.gpu
def test_gpu_token_ids_are_checked_in_eager_and_skipped_in_cuda_graphs():
    model = TransformerLM(TINY, device="cuda")
    tokens = torch.randint(0, 101, (2, 5), device="cuda")
    tokens[0, 3] = 101
    with pytest.raises(ValueError, match=r"`tokens` must hold ids in \[0, vocab_size=101\)"):
        model(tokens)  # no device-side assert: the process stays usable
    tokens[0, 3] = 7
    with torch.no_grad():
        model(tokens)  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(tokens)  # no check inside the capture (it would synchronize)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, model(tokens))


# --- TransformerLM targets -----------------------------------------------------------------------


@pytest.mark.parametrize("loss", ["eager", "fused"])
@pytest.mark.parametrize("bad", [-1, 101, -101, 10**6])
def test_targets_outside_the_vocabulary_are_refused(bad, loss):
    model = TransformerLM(TINY.replace(loss=loss))
    tokens = torch.randint(0, 101, (2, 5))
    targets = torch.randint(0, 101, (2, 5))
    targets[0, 0] = -100  # ignored: allowed
    targets[1, 3] = bad
    original = targets.clone()
    expected = (
        r"TransformerLM: `targets` must hold ids in \[0, vocab_size=101\) or -100 \(ignored\), "
        rf"got {bad} at position \(1, 3\)"
    )
    with pytest.raises(ValueError, match=expected):
        model(tokens, targets)
    assert torch.equal(targets, original)


@pytest.mark.parametrize("loss", ["eager", "fused"])
def test_ignored_and_boundary_targets_pass(loss):
    model = TransformerLM(TINY.replace(loss=loss))
    tokens = torch.randint(0, 101, (2, 5))
    targets = torch.tensor([[0, 100, -100, 5, 7], [-100, -100, 1, 2, 3]])
    logits = model(tokens)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(model(tokens, targets), expected)


def test_the_target_check_is_turned_off_with_the_token_check():
    model = TransformerLM(TINY, check_tokens=False)
    targets = torch.zeros(1, 2, dtype=torch.long)
    targets[0, 1] = 101
    with pytest.raises(IndexError):  # what F.cross_entropy says without the check
        model(torch.zeros(1, 2, dtype=torch.long), targets)


@pytest.mark.gpu
def test_gpu_targets_are_checked_in_eager():
    model = TransformerLM(TINY, device="cuda")
    tokens = torch.randint(0, 101, (2, 5), device="cuda")
    targets = torch.randint(0, 101, (2, 5), device="cuda")
    targets[0, 3] = 101
    with pytest.raises(ValueError, match=r"`targets` must hold ids in \[0, vocab_size=101\)"):
        model(tokens, targets)  # no device-side assert: the process stays usable
    targets[0, 3] = -100
    assert model(tokens, targets).isfinite()


# --- TransformerLM parts and helpers -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32"], ids=str)
def test_a_dtype_that_is_not_floating_is_refused_naming_dtype(dtype):
    from llmsys.profiling.model import RMSNorm

    match = rf"`dtype` must be None or a floating dtype, got {dtype}"
    with pytest.raises(TypeError, match=rf"RMSNorm: {match}"):
        RMSNorm(8, dtype=dtype)
    with pytest.raises(TypeError, match=rf"TransformerLM: {match}"):
        TransformerLM(TINY, dtype=dtype)
    assert RMSNorm(8, dtype=torch.float64).weight.dtype == torch.float64


@pytest.mark.parametrize("model", ["model", None, torch.nn.Linear(2, 2)], ids=str)
def test_use_int8_linears_names_a_model_that_is_not_a_transformer_lm(model):
    from llmsys.profiling import use_int8_linears

    with pytest.raises(TypeError, match=r"use_int8_linears: `model` must be a TransformerLM, got"):
        use_int8_linears(model)


# --- other config dataclasses --------------------------------------------------------------------


def h100(**changes) -> HardwareSpec:
    fields = dict(name="x", memory_bandwidth=3e12, matmul_flops={"bf16": 1e15})
    return HardwareSpec(**(fields | changes))


@pytest.mark.parametrize("sm_count", [1.5, 132.0, "132", 0, -1, True, NAN])
def test_sm_count_must_be_a_positive_int(sm_count):
    with pytest.raises(ValueError, match=r"`sm_count` must be a positive"):
        h100(sm_count=sm_count)
    assert h100(sm_count=132).sm_count == 132


@pytest.mark.parametrize(
    ("field", "value"),
    [("memory_bandwidth", NAN), ("memory_bandwidth", INF), ("l2_bytes", -1.0),
     ("min_kernel_time", NAN), ("host_link", 3)],
)  # fmt: skip
def test_hardware_fields_must_be_finite(field, value):
    with pytest.raises(ValueError, match=rf"`{field}` must be"):
        h100(**{field: value})


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dtype": "fp16"}, r"`dtype` must be one of \('fp32', 'bf16'\), got 'fp16'"),
        ({"optimizer": "sgd"}, r"`optimizer` must be one of"),
        ({"compile_mode": "fast"}, r"`compile_mode` must be one of"),
        ({"attention": "flash2"}, r"`attention` must be one of"),
        ({"norm": "triton"}, r"`norm` must be one of \('eager', 'fused'\), got 'triton'"),
        ({"loss": "chunked"}, r"`loss` must be one of"),
        ({"compile": "yes"}, r"`compile` must be a bool"),
        ({"preset": None}, r"`preset` must be a str"),
    ],
)
def test_variant_fields_are_checked(changes, match):
    with pytest.raises(ValueError, match=match):
        Variant(**changes)


SHAPE = dict(name="s", num_layers=2, params_per_layer=10, other_params=0, d_model=4,
             activations_replicated=4, activations_sharded=8, tp_all_reduces=1)  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_layers", 0), ("d_model", 1.5), ("params_per_layer", -1), ("tp_all_reduces", NAN)],
)
def test_model_shape_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=rf"ModelShape: `{field}` must be an int >= "):
        ModelShape(**(SHAPE | {field: value}))


@pytest.mark.parametrize(
    ("latency", "bandwidth", "match"),
    [(NAN, 1e9, "`latency`"), (-1e-6, 1e9, "`latency`"), (1e-6, 0, "`bandwidth`"),
     (1e-6, INF, "`bandwidth`"), (1e-6, NAN, "`bandwidth`")],
)  # fmt: skip
def test_link_fields_are_checked(latency, bandwidth, match):
    with pytest.raises(ValueError, match=rf"Link\(l\): {match} must be a finite number"):
        Link("l", latency, bandwidth)
