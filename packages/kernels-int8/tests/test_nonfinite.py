"""Non-finite inputs (issue 29): one behaviour, shared by the Triton kernel and the eager spec.

A row holding a NaN or an Inf gets a NaN scale and q = 0, so every GEMM output of that row is
NaN; finite rows are unaffected. ``check_finite=True`` refuses such a row instead, naming it,
except where reading the answer back would need a synchronization (CUDA-graph capture,
torch.compile). NaN payloads are not part of the contract (eager and the GPU write different
NaN bits into a bfloat16), so NaNs are compared by position.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from llmsys.kernels_int8 import (
    Int8Linear,
    matmul_int8,
    matmul_int8_reference,
    matmul_quantize_int8,
    matmul_quantize_int8_reference,
    ops,
    quantize_int8,
    quantize_int8_perrow,
    quantize_int8_perrow_reference,
    quantize_linears,
    tuning,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BAD_VALUES = [float("nan"), float("inf"), -float("inf")]


def with_bad_rows(m: int, k: int, dtype, device, bad_value: float) -> tuple[torch.Tensor, list]:
    """Random (m, k) rows with ``bad_value`` planted in rows 1 and m - 2 (at a column past the
    first block for long rows), the other rows finite."""
    x = (3 * torch.randn(m, k, device=device)).to(dtype)
    bad = sorted({1, m - 2})
    for row in bad:
        x[row, (row * 7919) % k] = bad_value
    return x, bad


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bits where finite, NaN at the same places."""
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def assert_quantizer_contract(x, q, scale, bad_rows) -> None:
    finite_rows = [r for r in range(x.shape[0]) if r not in bad_rows]
    assert scale[bad_rows].isnan().all(), scale
    assert (q[bad_rows] == 0).all()
    assert scale[finite_rows].isfinite().all()
    q_ref, scale_ref = quantize_int8_perrow_reference(x[finite_rows])
    if x.dtype == torch.bfloat16 and not x.is_cuda:  # the interpreter truncates bf16 scales
        assert torch.equal(scale[finite_rows].isnan(), scale_ref.isnan())
        return
    assert torch.equal(q[finite_rows], q_ref)
    assert torch.equal(scale[finite_rows], scale_ref)


@pytest.mark.parametrize("bad_value", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 70), (4, 20000)], ids=["one-pass", "two-pass"])
def test_nonfinite_row_gets_nan_scale_and_zero_q(
    shape, dtype, bad_value, device, poisoned_allocations
):
    x, bad_rows = with_bad_rows(*shape, dtype, device, bad_value)
    original = x.clone()
    q, scale = quantize_int8_perrow(x)
    assert_quantizer_contract(x, q, scale, bad_rows)
    q_ref, scale_ref = quantize_int8_perrow_reference(x)  # the spec says the same
    assert_quantizer_contract(x, q_ref, scale_ref, bad_rows)
    if dtype != torch.bfloat16 or x.is_cuda:  # the interpreter truncates bf16 scales
        assert torch.equal(q, q_ref)
    assert_same(x, original)  # the input is not touched


@pytest.mark.parametrize("bad_value", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_nonfinite_weight_column_gives_nan_scale(bad_value, device):
    w = torch.randn(40, 6, device=device)
    w[3, 2] = bad_value
    q, scale = quantize_int8(w, axis=0)
    assert scale.isnan().tolist() == [False, False, True, False, False, False]
    assert (q[:, 2] == 0).all()


@pytest.mark.parametrize("bad_value", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_matmul_quantize_nonfinite_row_gives_nan_outputs(
    dtype, bad_value, device, poisoned_allocations
):
    x, bad_rows = with_bad_rows(6, 64, dtype, device, bad_value)
    q_b, b_scale = quantize_int8(torch.randn(64, 24, device=device, dtype=dtype))
    out = matmul_quantize_int8(x, q_b, b_scale)  # (6, 24)
    assert_same(out, matmul_quantize_int8_reference(x, q_b, b_scale))
    nan_rows = out.isnan().all(dim=1)
    assert nan_rows.tolist() == [r in bad_rows for r in range(6)]
    assert out[~nan_rows].isfinite().all()


@pytest.mark.parametrize(
    "config",
    [
        tuning.MatmulConfig(16, 32, 32),
        tuning.MatmulConfig(16, 64, 32, split_k=4, num_warps=4, num_stages=2),
        tuning.MatmulConfig(64, 32, 64, num_warps=4, num_stages=2, tma=True),
        tuning.MatmulConfig(32, 64, 32, num_warps=4, num_stages=2, tma=True, tma_store=True),
        tuning.MatmulConfig(16, 64, 32, num_warps=4, num_stages=2, tma=True, swap_ab=True),
    ],
    ids=["pointer", "split-k", "tma", "tma-store", "tma-swap"],
)
def test_every_gemm_path_spreads_a_nan_scale_over_its_row(config, monkeypatch, device):
    m, n, k = 40, 64, 128
    x, bad_rows = with_bad_rows(m, k, torch.float16, device, float("nan"))
    a, a_scale = quantize_int8_perrow(x)
    b, b_scale = quantize_int8(torch.randn(k, n, device=device, dtype=torch.float16))
    bias = torch.randn(n, device=device, dtype=torch.float16)
    monkeypatch.setattr(tuning, "matmul_candidates", lambda m, n, k: [config])
    out = matmul_int8(a, a_scale, b, b_scale, bias=bias)
    assert_same(out, matmul_int8_reference(a, a_scale, b, b_scale, bias))
    assert out.isnan().all(dim=1).tolist() == [r in bad_rows for r in range(m)]


# --- property: kernel == spec for any planted values ----------------------------------------


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    m=st.integers(1, 9),
    k=st.integers(1, 80),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    planted=st.lists(
        st.tuples(
            st.integers(0, 10**6),
            st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, 1e-30, 6e4]),
        ),
        max_size=4,
    ),
)
def test_property_kernel_equals_spec_for_any_values(m, k, dtype, planted, device):
    x = (3 * torch.randn(m, k, device=device)).to(dtype)
    for position, value in planted:
        x.view(-1)[position % x.numel()] = value
    original = x.clone()
    q, scale = quantize_int8_perrow(x)
    q_ref, scale_ref = quantize_int8_perrow_reference(x)
    assert torch.equal(q, q_ref)
    assert_same(scale, scale_ref)
    assert torch.equal(scale.isnan(), ~x.isfinite().all(dim=1))
    assert_same(x, original)


# --- the opt-in refusal ----------------------------------------------------------------------


def test_check_finite_rows_names_the_first_bad_row(device):
    x, _ = with_bad_rows(6, 10, torch.float32, device, float("inf"))
    with pytest.raises(ValueError, match=r"`x` must be finite .* row 1 of 2 such row"):
        ops.check_finite_rows("op", "x", x)
    ops.check_finite_rows("op", "x", torch.randn(3, 4, device=device))  # finite: passes
    ops.check_finite_rows("op", "x", torch.empty(0, 4, device=device))


def test_check_finite_rows_is_skipped_where_it_cannot_synchronize(monkeypatch, device):
    x, _ = with_bad_rows(4, 10, torch.float32, device, float("nan"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    ops.check_finite_rows("op", "x", x)  # no error: the check would need the value on the host


def test_check_finite_rows_does_not_run_under_compile(device):
    x, _ = with_bad_rows(4, 10, torch.float32, device, float("nan"))

    def checked_plus_one(t):
        ops.check_finite_rows("op", "x", t)
        return t + 1

    assert torch.compile(checked_plus_one, backend="eager")(x).isnan().any()


@pytest.mark.parametrize("bad_value", BAD_VALUES, ids=["nan", "inf", "-inf"])
def test_int8_linear_nonfinite_token_gives_nan_outputs_or_refuses(bad_value, device):
    layer = nn.Linear(32, 12, device=device)
    x, bad_rows = with_bad_rows(5, 32, torch.float32, device, bad_value)
    x = x.reshape(1, 5, 32)
    with torch.no_grad():
        out = Int8Linear.from_float(layer)(x)[0]  # (5, 12)
        assert out.isnan().all(dim=1).tolist() == [r in bad_rows for r in range(5)]
        strict = Int8Linear.from_float(layer, check_finite=True)
        with pytest.raises(ValueError, match=r"Int8Linear: `x` must be finite .* row 1 "):
            strict(x)
        strict(x.nan_to_num())  # finite rows pass


def test_from_float_nonfinite_weight(device):
    layer = nn.Linear(16, 4, device=device)
    with torch.no_grad():
        layer.weight[2, 5] = float("nan")
        out = Int8Linear.from_float(layer)(torch.randn(3, 16, device=device))
    assert out.isnan().all(dim=0).tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match=r"`linear.weight` must be finite .* row 2 "):
        Int8Linear.from_float(layer, check_finite=True)


def test_check_finite_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`check_finite` must be a bool, got str"):
        Int8Linear(4, 4, check_finite="yes")
    with pytest.raises(TypeError, match=r"`check_finite` must be a bool, got int"):
        quantize_linears(nn.Sequential(nn.Linear(3, 4)), check_finite=1)


@pytest.mark.parametrize("value", ["no", None, 1], ids=["str", "None", "int"])
def test_the_public_functions_take_only_a_bool_check_finite(value):
    x = torch.randn(4, 24)
    q_b, b_scale = quantize_int8(torch.randn(24, 8))
    calls = {
        "quantize_int8_perrow": lambda: quantize_int8_perrow(x, check_finite=value),
        "quantize_int8": lambda: quantize_int8(x.t(), check_finite=value),
        "matmul_quantize_int8": lambda: matmul_quantize_int8(x, q_b, b_scale, check_finite=value),
    }
    for name, call in calls.items():
        with pytest.raises(
            TypeError, match=rf"{name}: `check_finite` must be a bool, got {type(value).__name__}"
        ):
            call()


def test_quantize_linears_check_finite_leaves_the_model_unchanged_on_refusal():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"`linear.weight` must be finite"):
        quantize_linears(model, check_finite=True)
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("bad_value", BAD_VALUES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 2048), (5, 20000)], ids=["one-pass", "two-pass"])
def test_gpu_nonfinite_rows_match_the_spec(shape, dtype, bad_value, poisoned_allocations):
    x, bad_rows = with_bad_rows(*shape, dtype, "cuda", bad_value)
    q, scale = quantize_int8_perrow(x)
    q_ref, scale_ref = quantize_int8_perrow_reference(x)
    assert torch.equal(q, q_ref)
    assert_same(scale, scale_ref)
    assert_quantizer_contract(x, q, scale, bad_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 1000], ids=["decode", "prefill"])
def test_gpu_matmul_quantize_nonfinite_rows(m, poisoned_allocations):
    x, bad_rows = with_bad_rows(m, 2048, torch.float16, "cuda", float("nan"))
    x[m // 2, 7] = float("inf")
    bad_rows = sorted({*bad_rows, m // 2})
    q_b, b_scale = quantize_int8(torch.randn(2048, 4096, device="cuda", dtype=torch.float16))
    out = matmul_quantize_int8(x, q_b, b_scale)
    assert_same(out, matmul_quantize_int8_reference(x, q_b, b_scale))
    assert out.isnan().all(dim=1).tolist() == [r in bad_rows for r in range(m)]


@pytest.mark.gpu
def test_gpu_check_finite_in_eager_and_skipped_in_cuda_graph():
    layer = Int8Linear.from_float(nn.Linear(256, 128, device="cuda", dtype=torch.float16))
    layer.check_finite = True
    x = torch.randn(8, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        layer(x)  # compile outside the capture
        x[3, 0] = float("nan")
        with pytest.raises(ValueError, match=r"row 3 "):
            layer(x)
        x[3, 0] = 0.0
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)  # no check (it would synchronize): capture must not fail
        x[5, 1] = float("nan")
        graph.replay()
        torch.cuda.synchronize()
    assert out.isnan().all(dim=1).tolist() == [r == 5 for r in range(8)]


def test_the_public_functions_refuse_non_finite_rows_when_asked(device):
    x = torch.randn(4, 24, device=device)
    x[2, 5] = float("nan")
    q_b, b_scale = quantize_int8(torch.randn(24, 8, device=device))
    with pytest.raises(ValueError, match=r"`x` must be finite .* row 2"):
        quantize_int8_perrow(x, check_finite=True)
    with pytest.raises(ValueError, match=r"`fpa` must be finite .* row 2"):
        matmul_quantize_int8(x, q_b, b_scale, check_finite=True)
    with pytest.raises(ValueError, match=r"`weight` must be finite .* row 2"):
        quantize_int8(x.t(), check_finite=True)  # (K, N) quantized per column: column 2
    assert quantize_int8_perrow(x)[1][2].isnan()  # the default: a NaN scale, no error
