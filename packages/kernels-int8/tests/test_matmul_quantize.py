"""int8_matmul_quantize, the op Int8Linear calls: the quantizer then the GEMM in one op call.
It must equal the two ops called one after the other, bit for bit."""

import pytest
import torch

from llmsys.kernels_int8 import matmul_int8, ops, quantize_int8, quantize_int8_perrow

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def operands(m, k, n, dtype, device, bias):
    generator = torch.Generator().manual_seed(m * 1000 + k + n)
    x = (torch.randn(m, k, generator=generator) * 3).to(dtype).to(device)
    w = (torch.randn(n, k, generator=generator) * 0.05).to(dtype).to(device)  # (N, K)
    b, b_scale = quantize_int8(w.t())  # (K, N) column-major, (N,)
    bias = (torch.randn(n, generator=generator) * 0.1).to(dtype).to(device) if bias else None
    return x, b, b_scale, bias


def unfused(x, b, b_scale, bias):
    return matmul_int8(*quantize_int8_perrow(x), b, b_scale, bias=bias)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 256, 40), (5, 100, 33), (16, 512, 96), (17, 64, 8)])
def test_equals_the_quantizer_then_the_gemm(m, k, n, dtype, bias, device):
    x, b, b_scale, bias_ = operands(m, k, n, dtype, device, bias)
    out = torch.ops.llmsys.int8_matmul_quantize(x, b, b_scale, bias_)
    assert out.shape == (m, n) and out.dtype == dtype
    assert torch.equal(out, unfused(x, b, b_scale, bias_))


def test_a_row_with_a_nan_or_an_inf_gives_nan_in_that_row_only(device):
    x, b, b_scale, _ = operands(4, 256, 40, torch.float16, device, False)
    x[1, 7] = float("nan")
    x[2, 0] = float("inf")
    out = torch.ops.llmsys.int8_matmul_quantize(x, b, b_scale)
    assert out[1].isnan().all() and out[2].isnan().all()
    assert torch.equal(out[[0, 3]], unfused(x, b, b_scale, None)[[0, 3]])
    assert not out[[0, 3]].isnan().any()


def test_zero_rows_and_an_all_zero_row(device):
    x, b, b_scale, _ = operands(3, 256, 40, torch.float32, device, False)
    assert torch.ops.llmsys.int8_matmul_quantize(x[:0], b, b_scale).shape == (0, 40)
    x[1] = 0
    out = torch.ops.llmsys.int8_matmul_quantize(x, b, b_scale)
    assert torch.equal(out[1], torch.zeros(40, device=device))
    assert torch.equal(out, unfused(x, b, b_scale, None))


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        ({"x": torch.zeros(2, 8, dtype=torch.float64)}, TypeError, r"`x` must have dtype"),
        ({"x": torch.zeros(8)}, ValueError, r"`x` must be 2-D"),
        (
            {"b": torch.zeros(9, 5, dtype=torch.int8)},
            ValueError,
            r"`b` must have K = x.shape\[1\] = 8",
        ),
        ({"b": torch.zeros(8, 5)}, TypeError, r"`b` must have dtype in \(int8\)"),
        ({"b_scale": torch.ones(4)}, ValueError, r"`b_scale` must have shape \(5,\)"),
        ({"bias": torch.ones(6)}, ValueError, r"`bias` must have shape \(5,\)"),
        ({"bias": torch.ones(5, dtype=torch.int32)}, TypeError, r"`bias` must have dtype"),
        ({"b_scale": torch.ones(5, device="meta")}, ValueError, r"`b_scale` must be on the device"),
    ],
)
def test_bad_input_is_named(change, error, pattern):
    args = {
        "x": torch.zeros(2, 8),
        "b": torch.zeros(8, 5, dtype=torch.int8),
        "b_scale": torch.ones(5),
        "bias": None,
        **change,
    }
    with pytest.raises(error, match=pattern):
        ops.matmul_quantize(**args)


def test_refuses_gradients():
    x, b, b_scale, _ = operands(2, 64, 8, torch.float32, "cpu", False)
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.ops.llmsys.int8_matmul_quantize(x, b, b_scale, torch.zeros(8, requires_grad=True))


def test_opcheck():
    x, b, b_scale, bias = operands(3, 64, 8, torch.float32, "cpu", True)
    torch.library.opcheck(torch.ops.llmsys.int8_matmul_quantize, (x, b, b_scale, bias))
