"""Int8Linear and quantize_linears: the module equals the functional composition, stays close to
the float layer, refuses autograd, and swaps exactly the layers it is asked to."""

import pytest
import torch
from torch import nn

from llmsys.kernels_int8 import (
    Int8Linear,
    matmul_int8_reference,
    quantize_int8_perrow,
    quantize_linears,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def float_linear(k, n, bias, dtype, device) -> nn.Linear:
    layer = nn.Linear(k, n, bias=bias, device=device)
    with torch.no_grad():
        layer.weight.normal_(0, 0.02)
    return layer.to(dtype)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_from_float_equals_the_functional_composition(dtype, bias, device):
    layer = float_linear(300, 70, bias, dtype, device)
    module = Int8Linear.from_float(layer)
    x = torch.randn(2, 3, 300, device=device).to(dtype)
    out = module(x)
    assert out.shape == (2, 3, 70) and out.dtype == dtype
    q_x, x_scale = quantize_int8_perrow(x.reshape(6, 300))
    q_w, w_scale = quantize_int8_perrow(layer.weight.detach())
    expected = matmul_int8_reference(q_x, x_scale, q_w.t(), w_scale, layer.bias)
    tolerance = {"rtol": 2**-7, "atol": 0} if dtype == torch.bfloat16 and device == "cpu" else {}
    if tolerance:  # the interpreter truncates the bfloat16 output cast
        torch.testing.assert_close(out.reshape(6, 70), expected, **tolerance)
    else:
        assert torch.equal(out.reshape(6, 70), expected)


def test_a_bias_replaced_by_a_parameter_is_used(device):
    """The forward reads its buffers from `_buffers`; a bias reassigned as a frozen Parameter
    (no longer a buffer) is still found and used."""
    module = Int8Linear.from_float(float_linear(64, 16, True, torch.float32, device))
    x = torch.randn(5, 64, device=device)
    with torch.no_grad():
        before = module(x)
        module.bias = nn.Parameter(module.bias + 1.0, requires_grad=False)
        torch.testing.assert_close(module(x), before + 1.0, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_close_to_the_float_layer(dtype, device):
    layer = float_linear(2048, 64, True, dtype, device)
    x = torch.randn(16, 2048, device=device).to(dtype)
    with torch.no_grad():
        err = (Int8Linear.from_float(layer)(x).double() - layer(x).double()).abs()
    assert err.mean() < 0.03 and err.flatten().quantile(0.95) < 0.07


def test_buffers_layout_and_state_dict_round_trip(device):
    layer = float_linear(70, 33, True, torch.float16, device)
    module = Int8Linear.from_float(layer)
    assert module.qweight.shape == (33, 70) and module.qweight.dtype == torch.int8
    assert module.qweight.t().stride() == (1, 70)  # the GEMM's fast column-major B
    assert module.weight_scale.dtype == torch.float16 and not list(module.parameters())
    fresh = Int8Linear(70, 33, device=device)
    fresh.load_state_dict(module.state_dict())
    x = torch.randn(5, 70, device=device, dtype=torch.float16)
    assert torch.equal(fresh(x), module(x))
    assert "in_features=70, out_features=33, bias=True" in repr(module)


def test_raises_under_autograd_and_runs_without(device):
    module = Int8Linear.from_float(float_linear(70, 33, True, torch.float32, device))
    x = torch.randn(5, 70, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="Int8Linear is inference-only"):
        module(x)
    with torch.no_grad():
        assert module(x).shape == (5, 33)
    with torch.inference_mode():
        assert module(x.detach()).shape == (5, 33)
    assert module(x.detach()).shape == (5, 33)  # grad mode on, but nothing requires grad


def test_compile_fullgraph(device):
    module = Int8Linear.from_float(float_linear(70, 33, True, torch.float16, device))
    x = torch.randn(2, 5, 70, device=device, dtype=torch.float16)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), module(x))


@pytest.mark.parametrize(
    ("build", "error", "pattern"),
    [
        (lambda: Int8Linear(0, 3), ValueError, r"`in_features` must be a positive int"),
        (lambda: Int8Linear(3, True), ValueError, r"`out_features` must be a positive int"),
        (lambda: Int8Linear(3, 4, dtype=torch.int8), TypeError, r"`dtype` must be float16"),
        (lambda: Int8Linear.from_float(nn.Conv1d(1, 1, 1)), TypeError, r"`linear` must be"),
        (lambda: Int8Linear.from_float(nn.Linear(3, 4).double()), TypeError, r"weight must be"),
        (lambda: Int8Linear(3, 4)(torch.randn(2, 5).half()), ValueError, r"`x` must have shape"),
        (lambda: Int8Linear(3, 4)(torch.randn(2, 3).double()), TypeError, r"`x` must have dtype"),
    ],
    ids=["in0", "out-bool", "dtype", "not-linear", "float64", "x-shape", "x-dtype"],
)
def test_bad_input_raises(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


# --- quantize_linears ----------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, device=device)  # out_proj: a Linear subclass
        self.mlp = nn.Sequential(nn.Linear(16, 48, device=device), nn.GELU())
        self.mlp.append(nn.Linear(48, 16, device=device))
        self.head = nn.ModuleDict({"proj": nn.Linear(16, 5, bias=False, device=device)})

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head["proj"](x + self.mlp(x))


def swapped(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Int8Linear)]


def test_quantize_linears_swaps_every_plain_linear_in_place(device):
    model = Block(device)
    x = torch.randn(7, 2, 16, device=device)
    with torch.no_grad():
        expected = model(x)
        assert quantize_linears(model) is model
        got = model(x)
    assert swapped(model) == ["mlp.0", "mlp.2", "head.proj"]
    assert type(model.attn.out_proj) is not Int8Linear  # MHA reads its weight directly
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.parametrize(
    ("include", "expected"),
    [
        ("mlp.*", ["mlp.0", "mlp.2"]),
        (["head.*", "mlp.2"], ["mlp.2", "head.proj"]),
        (lambda name, layer: layer.out_features == 48, ["mlp.0"]),
    ],
    ids=["pattern", "patterns", "callable"],
)
def test_quantize_linears_include(include, expected, device, caplog):
    with caplog.at_level("INFO", logger="llmsys.kernels_int8.modules"):
        model = quantize_linears(Block(device), include=include)
    assert swapped(model) == expected
    assert f"swapped {len(expected)} nn.Linear for Int8Linear: {expected}" in caplog.text


@pytest.mark.parametrize(
    "include", [[], "nothing.*", lambda name, layer: False], ids=["empty", "pattern", "callable"]
)
def test_quantize_linears_refuses_to_swap_nothing(include, device):
    model = Block(device)
    with pytest.raises(ValueError, match=r"`include` .* must select at least one nn.Linear"):
        quantize_linears(model, include=include)
    assert swapped(model) == []
    with pytest.raises(ValueError, match=r"which has no nn.Linear layer"):
        quantize_linears(nn.Sequential(nn.ReLU()))


def test_quantize_linears_bad_input():
    with pytest.raises(ValueError, match=r"`model` is itself an nn.Linear"):
        quantize_linears(nn.Linear(3, 4))
    with pytest.raises(TypeError, match=r"`model` must be an nn.Module"):
        quantize_linears("model")
    with pytest.raises(TypeError, match=r"`include` must be None, a pattern string"):
        quantize_linears(nn.Sequential(nn.Linear(3, 4)), include=[3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_int8_linear_bit_exact_with_the_composition(dtype):
    layer = float_linear(2048, 6144, True, dtype, "cuda")
    module = Int8Linear.from_float(layer)
    x = torch.randn(4, 33, 2048, device="cuda", dtype=dtype)
    q_x, x_scale = quantize_int8_perrow(x.reshape(-1, 2048))
    q_w, w_scale = quantize_int8_perrow(layer.weight.detach())
    expected = matmul_int8_reference(q_x, x_scale, q_w.t(), w_scale, layer.bias)
    assert torch.equal(module(x).reshape(-1, 6144), expected)
