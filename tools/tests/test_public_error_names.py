"""A public function's argument errors name the function the user called, not the op it runs
on (``swiglu(...)`` says ``swiglu:``, not ``swiglu_fwd:``), and its arguments by their public
names. Each case is an error the op's own check raises, past the function's checks, with and
without grad where the function has a backward."""

from __future__ import annotations

import pytest
import torch

from llmsys.flash_attn2 import append_kv_int8, decode_attention, flash_attention
from llmsys.kernels_fused import linear_cross_entropy, rotary, rotary_into_cache
from llmsys.kernels_int8 import (
    matmul_int8,
    matmul_quantize_int8,
    quantize_int8,
    quantize_int8_perrow,
)
from llmsys.kernels_swiglu import swiglu


def r(*shape, grad=False):
    return torch.randn(*shape, requires_grad=grad)


def int8(*shape):
    return torch.ones(*shape, dtype=torch.int8)


def int8_cache():
    """k_cache, v_cache, k_scale, v_scale of 8 slots, 2 kv heads, head dim 4."""
    cache, scale = int8(1, 2, 8, 4), torch.zeros(1, 2, 8)
    return cache, cache.clone(), scale, scale.clone()


def qkv_cos_sin():
    """q (1 sequence, 2 heads, 1 new token, head dim 8), k and v (1 kv head), cos and sin."""
    return r(1, 2, 1, 8), r(1, 1, 1, 8), r(1, 1, 1, 8), r(1, 1, 8), r(1, 1, 8)


CASES = {
    "swiglu": (lambda g: swiglu(r(3, grad=g), r(4)), ValueError, r"`b` must have the shape"),
    "flash_attention": (
        lambda g: flash_attention(r(1, 2, 4, 8, grad=g), r(1, 2, 4, 8), r(1, 2, 5, 8)),
        ValueError,
        r"`v` must have the shape of `k`",
    ),
    "decode_attention": (
        lambda g: decode_attention(r(1, 2, 1, 8), r(1, 2, 4, 8), r(1, 2, 5, 8), torch.tensor([2])),
        ValueError,
        r"`v_cache` must have the shape of `k_cache`",
    ),
    "append_kv_int8": (
        lambda g: append_kv_int8(r(1, 2, 1, 4), r(1, 2, 2, 4), *int8_cache(), torch.tensor([2])),
        ValueError,
        r"`v_new` must have the shape of `k_new`",
    ),
    "rotary": (
        lambda g: rotary(r(1, 2, 4, 8, grad=g), r(1, 2, 4, 8), r(1, 4, 8), r(1, 5, 8)),
        ValueError,
        r"`sin` must have the shape of `cos`",
    ),
    "rotary_into_cache": (
        lambda g: rotary_into_cache(
            *qkv_cos_sin(), r(1, 1, 4, 8), r(1, 1, 5, 8), torch.tensor([2])
        ),
        ValueError,
        r"`v_cache` must have the shape of `k_cache`",
    ),
    "linear_cross_entropy": (
        lambda g: linear_cross_entropy(r(4, 8, grad=g), r(10, 9), torch.zeros(4, dtype=torch.long)),
        ValueError,
        r"`weight` must have shape \(V, H\)",
    ),
    "matmul_int8": (
        lambda g: matmul_int8(int8(2, 4), r(2), int8(5, 3), r(3)),
        ValueError,
        r"`b` must have K",
    ),
    "matmul_quantize_int8": (
        lambda g: matmul_quantize_int8(int8(2, 4), int8(4, 3), r(3)),
        TypeError,
        r"`fpa` must have dtype in",
    ),
    "quantize_int8_perrow": (
        lambda g: quantize_int8_perrow(int8(2, 4)),
        TypeError,
        r"`x` must have dtype in",
    ),
    "quantize_int8": (lambda g: quantize_int8(int8(2, 4)), TypeError, r"`weight` must have dtype"),
}
WITH_BACKWARD = {"swiglu", "flash_attention", "rotary", "linear_cross_entropy"}


CALLS = [(name, False) for name in CASES] + [(name, True) for name in sorted(WITH_BACKWARD)]


@pytest.mark.parametrize("name, grad", CALLS)
def test_the_error_names_the_function_called(name, grad):
    call, error, message = CASES[name]
    with pytest.raises(error, match=rf"^{name}: {message}"):
        call(grad)
