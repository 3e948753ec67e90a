"""Per-row INT8 quantization: the Triton kernel against the eager spec at zero tolerance.

Under the interpreter (CPU) a float32 -> bfloat16 cast truncates instead of rounding to nearest
even, so a bfloat16 scale can sit one ulp below eager's there; the CPU bfloat16 checks compare
``q`` with the spec applied to the kernel's own scale and allow that one ulp, and the bit-exact
bfloat16 check is a GPU test.
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from llmsys.kernels_int8 import (
    ops,
    quantize_int8,
    quantize_int8_perrow,
    quantize_int8_perrow_reference,
    quantize_int8_reference,
    tuning,
)

# Primes and non-multiples of every block, one element, K not a power of 2, and a K past the
# one-pass limit (16384) that takes the two-pass kernel.
SHAPES = [(1, 1), (1, 70), (33, 70), (13, 300), (100, 33), (67, 1000), (3, 20000)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def rand(shape, dtype, device, scale: float = 3.0) -> torch.Tensor:
    return (scale * torch.randn(shape, device=device)).to(dtype)


def with_zero_rows(x: torch.Tensor) -> torch.Tensor:
    """Plant all-zero rows (first, middle) among random ones."""
    x = x.clone()
    x[0] = 0
    x[x.shape[0] // 2] = 0
    return x


def q_given_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The spec's q for a given stored scale, in float64 (exact for these operations)."""
    s = scale.double()[:, None]
    q = (x.double() / torch.where(s > 0, s, 1.0)).clamp(-127, 127).round()
    return torch.where(s > 0, q, 0.0).to(torch.int8)


def assert_matches_spec(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    q_ref, scale_ref = quantize_int8_perrow_reference(x)
    assert q.dtype == torch.int8 and scale.dtype == x.dtype
    assert q.shape == x.shape and scale.shape == x.shape[:1]
    if x.dtype == torch.bfloat16 and not x.is_cuda:  # the interpreter truncates the bf16 scale
        ulp = torch.finfo(torch.bfloat16).eps * scale_ref.float().abs()
        assert ((scale.float() - scale_ref.float()).abs() <= ulp).all()
        assert torch.equal(q, q_given_scale(x, scale))
        return
    assert torch.equal(scale, scale_ref), (scale - scale_ref).abs().max()
    assert torch.equal(q, q_ref), (q.int() - q_ref.int()).abs().max()


# --- against the spec ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_reference_exactly(shape, dtype, device, poisoned_allocations):
    x = rand(shape, dtype, device)
    q, scale = quantize_int8_perrow(x)
    assert_matches_spec(x, q, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(33, 70), (13, 300), (5, 20000)], ids=shape_id)
def test_planted_zero_rows_give_zero_scale_and_zeros(shape, dtype, device, poisoned_allocations):
    x = with_zero_rows(rand(shape, dtype, device))
    q, scale = quantize_int8_perrow(x)
    zero_rows = [0, shape[0] // 2]
    assert torch.isfinite(scale).all()
    assert (scale[zero_rows] == 0).all() and (q[zero_rows] == 0).all()
    assert_matches_spec(x, q, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zero_tensor(dtype, device, poisoned_allocations):
    x = torch.zeros(7, 300, dtype=dtype, device=device)
    q, scale = quantize_int8_perrow(x)
    assert (q == 0).all() and (scale == 0).all()


def test_float16_scale_that_underflows_gives_zeros(device, poisoned_allocations):
    # amax = 2**-20 -> amax / 127 is below float16's smallest subnormal (2**-24): scale 0.
    x = torch.full((3, 70), 2.0**-20, dtype=torch.float16, device=device)
    x[1] = rand((70,), torch.float16, device)
    q, scale = quantize_int8_perrow(x)
    assert scale[0] == 0 and (q[0] == 0).all() and scale[1] > 0
    assert_matches_spec(x, q, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(33, 70), (13, 300)], ids=shape_id)
def test_properties_in_float64(shape, dtype, device):
    """Independent of the spec's code: the scale is amax / 127 up to one rounding, every row's
    largest |q| is 127, and dequantizing is within half a step of x."""
    x = rand(shape, dtype, device)
    q, scale = quantize_int8_perrow(x)
    x64, s64 = x.double(), scale.double()
    amax = x64.abs().amax(dim=1)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(s64, amax / 127, rtol=eps, atol=0)
    assert (q.abs().amax(dim=1) == 127).all()
    assert (q.double() * s64[:, None] - x64).abs().le(0.5 * s64[:, None] * (1 + 1e-6)).all()


def test_values_on_half_steps_round_to_even(device):
    # scale = 127 / 127 = 1 exactly, so x / scale = x: ties go to the even neighbour.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]], device=device)
    q, scale = quantize_int8_perrow(x)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]


# --- layouts, empty tensors, dispatch paths ------------------------------------------------------


@pytest.mark.parametrize("layout", ["transposed", "sliced", "expanded"])
def test_strided_input_matches_contiguous(layout, device, poisoned_allocations):
    if layout == "transposed":
        x = rand((70, 33), torch.float16, device).t()
    elif layout == "sliced":
        x = rand((33, 140), torch.float16, device)[:, ::2]
    else:
        x = rand((1, 70), torch.float16, device).expand(33, 70)
    assert not x.is_contiguous()
    q, scale = quantize_int8_perrow(x)
    q_c, scale_c = quantize_int8_perrow(x.contiguous())
    assert torch.equal(q, q_c) and torch.equal(scale, scale_c) and q.is_contiguous()


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)], ids=shape_id)
def test_empty(shape, device):
    x = torch.empty(shape, dtype=torch.float16, device=device)
    q, scale = quantize_int8_perrow(x)
    assert q.shape == shape and q.dtype == torch.int8
    assert scale.shape == shape[:1] and (scale == 0).all()


CONFIGS = [
    tuning.QuantizeConfig(1, 1024, True, 4),
    tuning.QuantizeConfig(4, 1024, True, 4),
    tuning.QuantizeConfig(16, 1024, True, 8),
    tuning.QuantizeConfig(1, 64, False, 4),
    tuning.QuantizeConfig(8, 256, False, 4),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_forced_configs_give_identical_results(dtype, monkeypatch, device, poisoned_allocations):
    x = with_zero_rows(rand((37, 1000), dtype, device))  # not a multiple of any block
    results = []
    for config in CONFIGS:
        monkeypatch.setattr(tuning, "quantize_config", lambda m, k, config=config: config)
        results.append(quantize_int8_perrow(x))
    for q, scale in results:
        assert torch.equal(q, results[0][0]) and torch.equal(scale, results[0][1])
    assert_matches_spec(x, *results[0])


def test_default_config_switches_to_two_passes_past_the_limit():
    assert tuning.quantize_config(16, tuning.ONE_PASS_MAX_K).one_pass
    assert not tuning.quantize_config(16, tuning.ONE_PASS_MAX_K + 1).one_pass


def test_poison_reaches_outputs(monkeypatch, device, poisoned_allocations):
    # Guards the fixture: with the kernel removed, every output element is poison.
    monkeypatch.setattr(ops, "launch", lambda *args, **kwargs: None)
    if device != "cuda":
        monkeypatch.setattr(ops, "CPU_RUNS_TRITON", True)
    q, scale = torch.ops.llmsys.int8_quantize_perrow(rand((5, 7), torch.float16, device))
    assert (q == -128).all() and torch.isnan(scale).all()


# --- quantize_int8 (weights) ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_int8_axis0_is_per_column_and_column_major(dtype, device):
    weight = rand((300, 70), dtype, device, scale=0.02)  # (K, N)
    q, scale = quantize_int8(weight)  # default axis=0
    assert q.shape == (300, 70) and q.stride() == (1, 300) and scale.shape == (70,)
    q_row, scale_row = quantize_int8_perrow(weight.t().contiguous())
    assert torch.equal(q, q_row.t()) and torch.equal(scale, scale_row)
    if dtype != torch.bfloat16 or device == "cuda":
        q_ref, scale_ref = quantize_int8_reference(weight, axis=0)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("axis", [1, -1])
def test_quantize_int8_axis1_is_per_row(axis, device):
    weight = rand((33, 70), torch.float16, device)
    q, scale = quantize_int8(weight, axis=axis)
    assert q.stride() == (70, 1) and scale.shape == (33,)
    q_ref, scale_ref = quantize_int8_reference(weight, axis=axis)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_quantize_int8_axis_minus2_equals_axis0(device):
    weight = rand((33, 70), torch.float16, device)
    assert all(
        torch.equal(u, v)
        for u, v in zip(quantize_int8(weight, -2), quantize_int8(weight, 0), strict=True)
    )


# --- autograd, compile, opcheck ------------------------------------------------------------------


def test_requires_grad_input_gives_outputs_without_grad(device):
    x = rand((5, 7), torch.float32, device).requires_grad_()
    q, scale = quantize_int8_perrow(x)
    assert not q.requires_grad and not scale.requires_grad
    assert torch.equal(q, quantize_int8_perrow(x.detach())[0])


def test_opcheck(device):
    x = rand((5, 70), torch.float16, device)
    torch.library.opcheck(torch.ops.llmsys.int8_quantize_perrow.default, (x,))


def test_compile_fullgraph_dynamic_shapes_compile_once(device):
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(quantize_int8_perrow, fullgraph=True, dynamic=True, backend=counter)
    for shape in [(5, 70), (9, 33)]:
        x = rand(shape, torch.float16, device)
        got, expected = compiled(x), quantize_int8_perrow(x)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert counter.frame_count == 1


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "error", "pattern"),
    [
        (torch.arange(6, dtype=torch.int32).reshape(2, 3), TypeError, r"`x` must have dtype"),
        (torch.randn(2, 3, dtype=torch.float64), TypeError, r"`x` must have dtype.*float64"),
        (torch.randn(6), ValueError, r"`x` must be 2-D"),
        (torch.randn(2, 3, 4), ValueError, r"`x` must be 2-D"),
    ],
    ids=["int32", "float64", "1-D", "3-D"],
)
def test_bad_x_raises(x, error, pattern):
    before = x.clone()
    with pytest.raises(error, match=pattern):
        quantize_int8_perrow(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("fn", [quantize_int8_perrow, quantize_int8])
def test_non_tensor_raises_type_error(fn):
    with pytest.raises(TypeError, match=r"must be a torch.Tensor, got list"):
        fn([[1.0, 2.0]])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"weight": torch.randn(2, 3, 4)}, ValueError, r"`weight` must be 2-D"),
        ({"weight": torch.randn(4, 3), "axis": 2}, ValueError, r"`axis` must be 0 or 1"),
        ({"weight": torch.randn(4, 3), "axis": True}, ValueError, r"`axis` must be 0 or 1"),
        ({"weight": torch.ones(4, 3, dtype=torch.int8)}, TypeError, r"^quantize_int8: `weight`"),
    ],
    ids=["3-D", "axis2", "axis-bool", "int8"],
)
def test_quantize_int8_bad_input_raises(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        quantize_int8(**kwargs)


# --- GPU only ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 11008), (7, 40000)], ids=shape_id)
def test_gpu_bit_exact_at_model_sizes(shape, dtype, poisoned_allocations):
    x = with_zero_rows(rand(shape, dtype, "cuda"))
    q, scale = quantize_int8_perrow(x)
    assert_matches_spec(x, q, scale)


@pytest.mark.gpu
def test_gpu_more_than_2_to_the_31_elements(poisoned_allocations):
    m, k = 2**20 + 7, 2048 + 64  # 2.2e9 elements
    if torch.cuda.mem_get_info()[0] < m * k * 4:  # x float16 + q int8, plus headroom
        pytest.skip("needs about 9 GB of free GPU memory")
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    q, scale = quantize_int8_perrow(x)
    for rows in (slice(0, 64), slice(m // 2, m // 2 + 64), slice(m - 64, m)):
        q_ref, scale_ref = quantize_int8_perrow_reference(x[rows])
        assert torch.equal(q[rows], q_ref) and torch.equal(scale[rows], scale_ref), rows
    del x, q, scale
    torch.cuda.empty_cache()
