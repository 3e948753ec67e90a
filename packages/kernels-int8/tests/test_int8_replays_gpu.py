"""Every op the package declares with ``define_op(..., replays=True)`` replays its recorded
launches at a typical decode shape (a few tokens of a 4096-wide model, bfloat16; the quantizing
GEMM also at a prefill shape, where it takes the TMA kernel): an impl that starts calling another
ATen op (a ``.sum()``, a ``.item()``) fails here instead of silently costing host time on every
call."""

import pytest
import torch

from llmsys.kernels_int8 import (
    ops,
    quantize_int8,
    quantize_int8_perrow,
    rms_norm_quantize_int8,
    silu_mul_quantize_int8,
)
from llmsys.kernels_int8.rms_norm_quantize import int8_rms_norm_quantize
from llmsys.kernels_int8.silu_mul_quantize import int8_silu_mul_quantize
from llmsys.triton_launch.testing import assert_replays

pytestmark = pytest.mark.gpu

ROWS, PREFILL_ROWS, HIDDEN, INTERMEDIATE = 8, 512, 4096, 14336
CASES = [
    "quantize",
    "matmul",
    "matmul_out",
    "matmul_quantize",
    "matmul_quantize_prefill",
    "silu_mul_quantize",
    "rms_norm_quantize",
    "rms_norm_quantize_residual",
]


def rand(*shape):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
def test_declared_op_replays(case):
    x, weight, residual = rand(ROWS, HIDDEN), rand(HIDDEN), rand(ROWS, HIDDEN)
    b, b_scale = quantize_int8(rand(HIDDEN, INTERMEDIATE) * 0.02)  # (K, N) column-major
    q, scale = quantize_int8_perrow(x)
    out = torch.empty(ROWS, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    gate, up = rand(ROWS, INTERMEDIATE), rand(ROWS, INTERMEDIATE)
    prefill = rand(PREFILL_ROWS, HIDDEN)
    call, op = {
        "quantize": (lambda: quantize_int8_perrow(x), ops.int8_quantize_perrow),
        "matmul": (lambda: ops.int8_matmul(q, scale, b, b_scale), ops.int8_matmul),
        "matmul_out": (
            lambda: ops.int8_matmul_out(q, scale, b, b_scale, None, out),
            ops.int8_matmul_out,
        ),
        "matmul_quantize": (
            lambda: ops.int8_matmul_quantize(x, b, b_scale),
            ops.int8_matmul_quantize,
        ),
        "matmul_quantize_prefill": (
            lambda: ops.int8_matmul_quantize(prefill, b, b_scale),
            ops.int8_matmul_quantize,
        ),
        "silu_mul_quantize": (lambda: silu_mul_quantize_int8(gate, up), int8_silu_mul_quantize),
        "rms_norm_quantize": (
            lambda: rms_norm_quantize_int8(x, weight, 1e-5),
            int8_rms_norm_quantize,
        ),
        "rms_norm_quantize_residual": (
            lambda: rms_norm_quantize_int8(x, weight, 1e-5, residual),
            int8_rms_norm_quantize,
        ),
    }[case]
    assert_replays(call, op)
