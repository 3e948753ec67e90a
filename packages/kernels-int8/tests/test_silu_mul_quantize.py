"""SiLU-and-mul fused with the per-token quantization: the Triton kernel against its eager spec,
``quantize_int8_perrow_reference(F.silu(gate) * up)``, at zero tolerance.

The spec's only transcendental is the exp inside SiLU. Under the interpreter the kernel's exp is
numpy's and eager's is PyTorch's CPU exp; they can differ in the last bit, which can move an int8
value across a rounding tie. So the CPU tests check both: bit-exact against the kernel's own
arithmetic written in eager with numpy's exp (any input), and bit-exact against the spec on the
seeded inputs here. On the GPU both use the same (libdevice) exp and the bit-exact checks against
the spec are GPU tests (test_silu_mul_quantize_gpu.py), bfloat16 included: the interpreter
truncates float32 -> bfloat16 casts, so bfloat16 is checked here up to that rounding.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from llmsys.kernels_int8 import (
    quantize_int8_perrow_reference,
    silu_mul_quantize_int8,
    silu_mul_quantize_int8_reference,
)
from llmsys.kernels_int8 import silu_mul_quantize as module

# Primes and non-multiples of every block, one element, and a row past one block (two passes).
SHAPES = [(1, 1), (1, 70), (13, 67), (7, 300), (3, 2000), (2, 5000)]
DTYPES = [torch.float16, torch.float32]


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def inputs(shape, dtype, device):
    gate = (3 * torch.randn(shape, device=device)).to(dtype)
    up = torch.randn(shape, device=device).to(dtype)
    return gate, up


def kernel_arithmetic(gate: torch.Tensor, up: torch.Tensor):
    """The kernel's formula in eager, with the interpreter's (numpy's) exp: exact on CPU."""
    g32 = gate.float()
    e = torch.from_numpy(np.exp(-g32.cpu().numpy())).to(gate.device)
    silu = (g32 / (1 + e)).to(gate.dtype)
    hidden = silu * up  # rounded to the dtype, as eager rounds `F.silu(gate) * up`
    return quantize_int8_perrow_reference(hidden.reshape(-1, gate.shape[-1]))


def assert_equal(got, expected):
    (q, scale), (q_ref, scale_ref) = got, expected
    assert q.dtype == torch.int8 and q.shape == q_ref.shape and q.is_contiguous()
    assert scale.dtype == scale_ref.dtype and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref), (scale - scale_ref).abs().max()
    assert torch.equal(q, q_ref), (q.int() - q_ref.int()).abs().max()


# --- against the spec ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_the_spec_exactly(shape, dtype, device, poisoned_allocations):
    gate, up = inputs(shape, dtype, device)
    got = silu_mul_quantize_int8(gate, up)
    assert_equal(got, silu_mul_quantize_int8_reference(gate, up))
    if device == "cpu":
        assert_equal(got, kernel_arithmetic(gate, up))


def test_bfloat16_up_to_the_interpreters_truncation(device):
    gate, up = inputs((13, 67), torch.bfloat16, device)
    q, scale = silu_mul_quantize_int8(gate, up)
    q_ref, scale_ref = silu_mul_quantize_int8_reference(gate, up)
    # Each of silu, the product and the scale may be one bfloat16 ulp off (truncated): at most a
    # few steps of the 127-step grid. The GPU test is bit-exact.
    assert torch.allclose(scale.float(), scale_ref.float(), rtol=2**-6, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= 2


def test_the_eager_spec_is_silu_then_the_product_rounded_then_quantized(device):
    gate, up = inputs((5, 33), torch.float16, device)
    hidden = F.silu(gate) * up  # float16: silu rounded, then the product
    assert_equal(silu_mul_quantize_int8_reference(gate, up), quantize_int8_perrow_reference(hidden))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_rows_give_zero_scale_and_zeros(dtype, device, poisoned_allocations):
    gate, up = inputs((9, 70), dtype, device)
    gate[0] = 0  # silu(0) = 0
    up[4] = 0
    q, scale = silu_mul_quantize_int8(gate, up)
    assert (scale[[0, 4]] == 0).all() and (q[[0, 4]] == 0).all()
    assert_equal((q, scale), silu_mul_quantize_int8_reference(gate, up))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: -inf / inf
@pytest.mark.parametrize("where", ["gate", "up"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_rows_get_nan_scale_and_zeros(dtype, bad, where, device, poisoned_allocations):
    gate, up = inputs((7, 67), dtype, device)
    (gate if where == "gate" else up)[3, 11] = bad
    q, scale = silu_mul_quantize_int8(gate, up)
    # silu(-inf) = -inf / inf is NaN and silu(inf) * up is +-inf: the row is non-finite either way
    assert torch.isnan(scale[3]) and (q[3] == 0).all()
    others = [0, 1, 2, 4, 5, 6]
    assert torch.isfinite(scale[others]).all()
    q_ref, scale_ref = silu_mul_quantize_int8_reference(gate, up)
    assert torch.equal(scale.isnan(), scale_ref.isnan()) and torch.equal(q, q_ref)
    assert torch.equal(scale[others], scale_ref[others])


# --- layouts, empty tensors, dispatch paths ------------------------------------------------------


def test_halves_of_a_fused_gemm_output_match_contiguous(device, poisoned_allocations):
    gate_up = 2 * torch.randn(13, 2 * 67, device=device)  # (M, 2N), as the gate/up GEMM writes it
    gate, up = gate_up[:, :67], gate_up[:, 67:]
    assert not gate.is_contiguous()
    assert_equal(
        silu_mul_quantize_int8(gate, up),
        silu_mul_quantize_int8(gate.contiguous(), up.contiguous()),
    )


def test_transposed_inputs_match_contiguous(device):
    gate, up = (t.t() for t in inputs((67, 13), torch.float32, device))
    assert_equal(
        silu_mul_quantize_int8(gate, up),
        silu_mul_quantize_int8(gate.contiguous(), up.contiguous()),
    )


def test_leading_dims_are_flattened(device):
    gate, up = inputs((2, 3, 70), torch.float16, device)
    q, scale = silu_mul_quantize_int8(gate, up)
    assert q.shape == (6, 70) and scale.shape == (6,)
    assert_equal((q, scale), silu_mul_quantize_int8(gate.reshape(6, 70), up.reshape(6, 70)))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (2, 0, 4)], ids=shape_id)
def test_empty(shape, device):
    gate, up = inputs(shape, torch.float16, device)
    q, scale = silu_mul_quantize_int8(gate, up)
    rows = int(np.prod(shape[:-1]))
    assert q.shape == (rows, shape[-1]) and q.dtype == torch.int8
    assert scale.shape == (rows,) and (scale == 0).all()


@pytest.mark.parametrize(
    "config", [(128, False, 4), (1024, True, 4)], ids=["two-passes", "one-pass"]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forced_configs_give_identical_results(config, dtype, device, poisoned_allocations):
    gate, up = inputs((3, 1000), dtype, device)  # 1000: not a multiple of any block
    gate[1] = 0
    got = module.silu_mul_quantize(gate, up, config)
    assert_equal(got, silu_mul_quantize_int8(gate, up))


def test_launch_config_is_the_quantizers_row_policy():
    assert module.launch_config(4096)[:2] == (4096, True)
    assert module.launch_config(14336)[1] is False  # Llama-3.1-8B's intermediate size


def test_poison_reaches_outputs(monkeypatch, device, poisoned_allocations):
    # Guards the fixture: with the kernel removed, every output element is poison.
    monkeypatch.setattr(module, "launch", lambda *args, **kwargs: None)
    if device != "cuda":
        monkeypatch.setattr(module, "CPU_RUNS_TRITON", True)
    q, scale = torch.ops.llmsys.int8_silu_mul_quantize(*inputs((5, 7), torch.float16, device))
    assert (q == -128).all() and torch.isnan(scale).all()


# --- autograd, compile, opcheck ------------------------------------------------------------------


def test_outputs_carry_no_gradient(device):
    gate, up = (t.requires_grad_() for t in inputs((5, 7), torch.float32, device))
    q, scale = silu_mul_quantize_int8(gate, up)
    assert not q.requires_grad and not scale.requires_grad
    q, scale = torch.ops.llmsys.int8_silu_mul_quantize(gate, up)
    assert not scale.requires_grad


def test_opcheck(device):
    torch.library.opcheck(
        torch.ops.llmsys.int8_silu_mul_quantize.default, inputs((5, 70), torch.float16, device)
    )


def test_compile_fullgraph_dynamic_shapes_compile_once(device):
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(silu_mul_quantize_int8, fullgraph=True, dynamic=True, backend=counter)
    for shape in [(5, 70), (9, 33)]:
        gate, up = inputs(shape, torch.float16, device)
        assert_equal(compiled(gate, up), silu_mul_quantize_int8(gate, up))
    assert counter.frame_count == 1


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gate", "up", "error", "pattern"),
    [
        ([1.0], torch.randn(1), TypeError, r"`gate` must be a torch.Tensor, got list"),
        (torch.randn(2, 3), None, TypeError, r"`up` must be a torch.Tensor, got NoneType"),
        (
            torch.ones(2, 3, dtype=torch.int8),
            torch.randn(2, 3),
            TypeError,
            r"`gate` must have dtype",
        ),
        (torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3), TypeError, r"`gate`.*float64"),
        (torch.randn(2, 3), torch.randn(2, 3).half(), TypeError, r"`up` must have the dtype of"),
        (torch.randn(2, 3), torch.randn(2, 4), ValueError, r"`up` must have the shape of `gate`"),
        (torch.tensor(1.0), torch.tensor(1.0), ValueError, r"`gate` must have at least one dim"),
    ],
    ids=["gate-list", "up-none", "int8", "float64", "dtypes-differ", "shapes-differ", "0-d"],
)
def test_bad_input_raises_naming_the_argument(gate, up, error, pattern):
    with pytest.raises(error, match=pattern):
        silu_mul_quantize_int8(gate, up)


def test_the_op_wants_2d_rows():
    with pytest.raises(ValueError, match=r"`gate` must be 2-D \(M, N\)"):
        torch.ops.llmsys.int8_silu_mul_quantize(torch.randn(2, 3, 4), torch.randn(2, 3, 4))
