"""Roofline op costs, hardware specs and their worked examples (hand-computed values)."""

from __future__ import annotations

import math

import pytest

from llmsys.profiling.infra import accounting, hardware, roofline
from llmsys.profiling.infra.hardware import HardwareSpec

# The worked examples' GPU: HBM 2.4 TB/s, 800 TFLOP/s, 10 us minimum per kernel.
TOY = HardwareSpec.custom("toy", memory_bandwidth=2.4e12, flops=800e12, min_kernel_time=10e-6)


def test_three_linears_about_63_us():
    costs = [roofline.linear(512, 4096, out, TOY) for out in (8192, 512, 512)]
    # 4096 -> 8192: 2*512*4096*8192 FLOPs / 800e12 = 42.95 us (compute bound); the two
    # 4096 -> 512 ones take 2.7 us of compute and 3.7 us of memory, so the 10 us minimum each
    assert [c.bound for c in costs] == ["compute", "launch", "launch"]
    assert costs[0].time == pytest.approx(2 * 512 * 4096 * 8192 / 800e12)
    assert roofline.total_time(costs) * 1e6 == pytest.approx(62.95, abs=0.01)
    assert round(roofline.total_time(costs) * 1e6) == 63


def test_fused_linear_about_48_us():
    cost = roofline.linear(512, 4096, 9216, TOY)
    assert cost.bound == "compute"
    assert cost.time * 1e6 == pytest.approx(48.32, abs=0.01)
    assert round(cost.time * 1e6) == 48


def test_divide_by_scalar_7158_us():
    cost = roofline.elementwise(64 * 8192 * 8192, TOY, "bf16")  # read x, write x / d; d free
    assert cost.bytes == 2 * 2 * 64 * 8192 * 8192
    assert cost.bound == "memory"
    assert cost.time * 1e6 == pytest.approx(7158.28, abs=0.01)


def test_vector_add_moves_12n_bytes():
    n = 1_000_000
    cost = roofline.elementwise(n, TOY, "fp32", inputs=2)
    assert cost.bytes == 12 * n
    assert cost.flops == n
    assert cost.intensity == pytest.approx(1 / 12)


def test_matmul_hand_computed():
    hw = HardwareSpec.custom("m", memory_bandwidth=1e12, flops=1e15, min_kernel_time=0.0)
    cost = roofline.matmul(100, 200, 300, hw, "fp32")
    assert cost.flops == 2 * 100 * 200 * 300
    assert cost.bytes == 4 * (100 * 300 + 300 * 200 + 100 * 200)
    assert cost.compute_time == pytest.approx(12e6 / 1e15)
    assert cost.memory_time == pytest.approx(440e3 / 1e12)
    assert cost.bound == "memory"
    assert cost.intensity == pytest.approx(12e6 / 440e3)


def test_matmul_uses_the_precision_peak():
    h100 = hardware.lookup("H100")
    big = roofline.matmul(8192, 8192, 8192, h100, "bf16")
    assert big.compute_time == pytest.approx(2 * 8192**3 / 989.4e12)
    assert roofline.matmul(8192, 8192, 8192, h100, "tf32").compute_time == pytest.approx(
        2 * 8192**3 / 494.7e12
    )
    with pytest.raises(ValueError, match="dtype"):
        roofline.matmul(1, 1, 1, h100, "int4")


def test_reduction_hand_computed():
    cost = roofline.reduction(1024 * 4096, TOY, "fp32", out_elements=1024)
    assert cost.bytes == 4 * (1024 * 4096 + 1024)
    assert cost.flops == 1024 * 4096
    assert cost.bound == "launch"


def test_attention_prefill_and_decode():
    h100 = hardware.lookup("H100")
    prefill = roofline.attention(2, 16, 4096, 4096, 128, h100)
    pairs = 4096 * 4097 / 2
    assert prefill.flops == 4 * 2 * 16 * pairs * 128
    assert prefill.bytes == 2 * (2 * 16 * 4096 + 2 * 16 * 4096) * 128 * 2
    assert prefill.bound == "compute"
    full = roofline.attention(2, 16, 4096, 4096, 128, h100, causal=False)
    assert full.flops == 4 * 2 * 16 * 4096 * 4096 * 128
    decode = roofline.attention(8, 32, 1, 4096, 128, h100, kv_heads=8)
    assert decode.flops == 4 * 8 * 32 * 4096 * 128
    assert decode.bytes == 8 * (2 * 32 * 1 + 2 * 8 * 4096) * 128 * 2
    assert decode.bound == "memory"
    assert decode.memory_time == pytest.approx(decode.bytes / 3.35e12)
    with pytest.raises(ValueError, match="q_len"):
        roofline.attention(1, 1, 10, 5, 8, h100)


def test_host_to_device():
    h100 = hardware.lookup("H100")
    big = roofline.host_to_device(64e6, h100)
    assert big.time == pytest.approx(64e6 / 64e9)
    assert big.bound == "memory"
    assert roofline.host_to_device(1000, h100).bound == "launch"


def test_bad_counts_rejected():
    with pytest.raises(ValueError, match="num_elements"):
        roofline.elementwise(-1, TOY)
    with pytest.raises(ValueError, match="dtype"):
        roofline.elementwise(1, TOY, "float64")


def test_datasheet_specs():
    h100 = hardware.lookup("NVIDIA H100 80GB HBM3")
    assert h100.name == "H100"
    assert (h100.sm_count, h100.memory_bandwidth, h100.l2_bytes) == (132, 3.35e12, 50e6)
    assert h100.l1_bytes_per_sm == 256e3
    assert h100.peak("bf16") == pytest.approx(989.4e12)
    assert h100.nvlink_bandwidth * 2 == pytest.approx(900e9)  # per direction
    assert "PCIe Gen5" in h100.host_link
    assert hardware.lookup("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert hardware.lookup("NVIDIA A100-SXM4-80GB").name == "A100"
    assert hardware.lookup("NVIDIA A10").name == "A10"
    for name in ("H200", "A100", "A10", "B200"):
        assert "datasheet" in hardware.lookup(name).source
    with pytest.raises(ValueError, match="name"):
        hardware.lookup("RTX 4090")


def test_accounting_peaks_come_from_the_hardware_table():
    for name, spec in hardware.HARDWARE.items():
        assert accounting.PEAK_TFLOPS[name]["bf16"] * 1e12 == pytest.approx(spec.peak("bf16"))
    assert accounting.peak_flops("NVIDIA H200", "tf32")[0] == pytest.approx(494.7e12)


@pytest.mark.parametrize(
    "field, value",
    [
        ("memory_bandwidth", 0),
        ("memory_bandwidth", -1.0),
        ("memory_bandwidth", math.inf),
        ("min_kernel_time", -1e-6),
        ("nvlink_bandwidth", 0.0),
        ("network_latency", math.nan),
        ("sm_count", True),
    ],
)
def test_bad_hardware_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        TOY.replace(**{field: value})


def test_bad_peaks_rejected():
    with pytest.raises(ValueError, match="matmul_flops"):
        HardwareSpec(name="x", memory_bandwidth=1e12, matmul_flops={})
    with pytest.raises(ValueError, match="matmul_flops"):
        HardwareSpec(name="x", memory_bandwidth=1e12, matmul_flops={"fp64": 1e12})
    with pytest.raises(ValueError, match="matmul_flops"):
        HardwareSpec(name="x", memory_bandwidth=1e12, matmul_flops={"bf16": -1.0})
    with pytest.raises(ValueError, match="flops"):
        HardwareSpec.custom("x", memory_bandwidth=1e12, flops=0)
    spec = HardwareSpec(name="x", memory_bandwidth=1e12, matmul_flops={"bf16": 1e12})
    with pytest.raises(ValueError, match="precision"):
        spec.peak("fp32")
    assert spec.elementwise_flops == 1e12


@pytest.mark.parametrize("value", ["no", None, 1])
def test_flags_take_only_a_bool(value):
    """Issue 49: ``causal="no"`` and ``always_tf32="no"`` were taken as True."""
    h100 = hardware.lookup("H100")
    with pytest.raises(TypeError, match=r"attention: `causal` must be a bool, got "):
        roofline.attention(2, 16, 64, 64, 128, h100, causal=value)
    with pytest.raises(TypeError, match=r"matmul_precision: `always_tf32` must be a bool, got "):
        accounting.matmul_precision("fp32", always_tf32=value)
