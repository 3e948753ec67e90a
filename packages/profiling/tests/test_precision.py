"""``llmsys-bench precision``: float16 accumulation error and the dtypes autocast produces."""

import math

import pytest
import torch

from llmsys.bench_harness import results
from llmsys.profiling import cli, precision

# What PyTorch's CPU autocast does to ToyModel (observed with torch 2.13). Unlike CUDA autocast,
# CPU autocast has no float32 policy for layer_norm: it runs in its input's precision.
CPU_AUTOCAST = {
    "bf16": {
        "parameters": "float32",
        "fc1 output": "bfloat16",
        "layernorm output": "bfloat16",
        "logits": "bfloat16",
        "loss": "float32",
        "gradients": "float32",
    },
    "fp16": {
        "parameters": "float32",
        "fc1 output": "float16",
        "layernorm output": "float16",
        "logits": "float16",
        "loss": "float32",
        "gradients": "float32",
    },
}
# CUDA autocast runs layer_norm in float32.
CUDA_AUTOCAST = {
    name: table | {"layernorm output": "float32"} for name, table in CPU_AUTOCAST.items()
}


def test_float16_accumulation_loses_more_than_float32():
    sums = precision.accumulate("cpu")
    errors = {way: abs(s.item() - 10.0) for way, s in sums.items()}
    assert sums["fp16 += fp16"].dtype == torch.float16
    assert sums["fp32 += fp16"].dtype == torch.float32
    assert errors["fp32 += fp32"] < 1e-3
    assert errors["fp16 += fp16"] > 10 * errors["fp32 += fp32"]
    assert errors["fp16 += fp16"] > 1e-2
    # A float32 accumulator keeps the float16 addend's rounding error (0.01 is not exact) but
    # not float16's accumulation error; converting the addend explicitly changes nothing.
    assert errors["fp32 += fp32"] < errors["fp32 += fp16"] < errors["fp16 += fp16"]
    assert sums["fp32 += fp16"].item() == sums["fp32 += fp16.float()"].item()


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_cpu_autocast_dtypes_of_toy_model(name):
    assert precision.autocast_unsupported("cpu", precision.AUTOCAST_DTYPES[name]) is None
    assert precision.autocast_dtypes("cpu", precision.AUTOCAST_DTYPES[name]) == CPU_AUTOCAST[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_cuda_autocast_dtypes_of_toy_model(name):
    assert precision.autocast_dtypes("cuda", precision.AUTOCAST_DTYPES[name]) == CUDA_AUTOCAST[name]


def test_unsupported_autocast_dtype_gives_a_reason():
    reason = precision.autocast_unsupported("cpu", torch.float64)
    assert isinstance(reason, str) and reason  # an explanation, not None


def test_cli_writes_both_tables(tmp_path, capsys):
    assert cli.main(["precision", "--device", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "fp16 += fp16" in printed and "layernorm output" in printed
    assert "| fp32 += fp32 | 10.00013 | abs_error=0.000133514 |" in printed  # not rounded to 10
    rows = results.read_rows(tmp_path / "precision.csv")

    sums = {r.provider: r for r in rows if r.kernel == "accumulate"}
    assert set(sums) == {"fp32 += fp32", "fp16 += fp16", "fp32 += fp16", "fp32 += fp16.float()"}
    for r in sums.values():
        assert r.mode == "sum" and r.x == "1000 x 0.01" and r.throughput_unit == "value"
        assert math.isnan(r.p50)
        error = float(r.config.removeprefix("abs_error="))
        assert error == pytest.approx(abs(r.throughput - 10.0), rel=1e-4)
    assert sums["fp16 += fp16"].dtype == "float16" and sums["fp32 += fp32"].dtype == "float32"

    observed = {(r.provider, r.mode): r.dtype for r in rows if r.kernel == "autocast"}
    expected = {(name, t): d for name, table in CPU_AUTOCAST.items() for t, d in table.items()}
    assert observed == expected


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["precision", "--help"])
    assert exit_.value.code == 0
    assert "--autocast" in capsys.readouterr().out


def test_bad_autocast_dtype_is_named(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["precision", "--out", str(tmp_path), "--autocast", "fp8"])
    assert exit_.value.code == 2
    assert "argument --autocast: invalid choice: 'fp8'" in capsys.readouterr().err
