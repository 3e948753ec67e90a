"""``HardwareSpec``: what a roofline estimate needs to know about a GPU and its links.

The built-in specs come from NVIDIA's datasheets (dense tensor-core FLOP/s, i.e. the sparsity
figure halved) and, for the architectural figures that datasheets leave out (SM count, L2, L1 /
shared memory), from the architecture whitepapers; ``HardwareSpec.source`` names them. Fields a
document does not give are ``None``. Units are SI throughout: bytes, seconds, bytes/s, FLOP/s
(a datasheet's "3.35 TB/s" is 3.35e12 bytes/s, its "50 MB" 50e6 bytes).

Link bandwidths are *per direction*: datasheets quote NVLink and PCIe with both directions
summed (H100's "NVLink 900 GB/s" is 450 GB/s each way; "PCIe Gen5 128 GB/s" is 64 GB/s each
way), and a ring collective or a host-to-device copy moves data one way over each link.

Latencies and the minimum kernel time are not datasheet figures: the defaults below are typical
values (a kernel launch and an empty kernel take a few microseconds; an NCCL step over NVLink a
few microseconds; over InfiniBand somewhat more) to be replaced with measured ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

GB = 1e9  # decimal, as datasheets use it
TB = 1e12
TFLOPS = 1e12
US = 1e-6

PRECISIONS = ("bf16", "tf32", "fp32", "int8")  # int8: tera-operations per second

# Typical, not from a datasheet (see the module docstring).
DEFAULT_MIN_KERNEL_TIME = 4 * US
DEFAULT_NVLINK_LATENCY = 5 * US
DEFAULT_NETWORK_LATENCY = 10 * US
DEFAULT_HOST_LINK_LATENCY = 10 * US
# One 400 Gb/s InfiniBand NDR NIC per GPU (as in DGX H100 / H200 / B200): 50 GB/s each way.
DEFAULT_NETWORK_BANDWIDTH = 50 * GB


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One GPU as the roofline sees it.

    Args:
        name: a short name ("H100", "my-gpu").
        memory_bandwidth: HBM / DRAM bandwidth in bytes/s.
        matmul_flops: dense tensor-core peak in FLOP/s by precision ("bf16", "tf32", "fp32";
            fp16 runs at the bf16 rate). At least one entry.
        vector_flops: FLOP/s of elementwise work on the CUDA cores (fp32, non-tensor). Default
            None: ``matmul_flops["fp32"]``, else the smallest matmul peak.
        min_kernel_time: the shortest a kernel takes however little it does (launch and
            scheduling), in seconds. Default 4 us.
        memory_capacity: device memory in bytes, or None.
        sm_count: streaming multiprocessors (a positive int), or None.
        l2_bytes: L2 cache in bytes, or None.
        l1_bytes_per_sm: combined L1 / shared memory per SM in bytes, or None.
        nvlink_bandwidth: NVLink bandwidth per GPU and direction in bytes/s; None without
            NVLink (collectives inside a node then use the host link).
        nvlink_latency: seconds per collective step over NVLink. Default 5 us.
        network_bandwidth: between-node bandwidth per GPU and direction in bytes/s. Default
            50e9 (one 400 Gb/s NIC per GPU).
        network_latency: seconds per collective step between nodes. Default 10 us.
        host_link: the host interface's name ("PCIe Gen5 x16").
        host_link_bandwidth: host-to-device bandwidth per direction in bytes/s.
        host_link_latency: seconds per host-to-device copy. Default 10 us.
        source: the documents the numbers come from.

    Raises:
        ValueError: naming the field, for a bandwidth, FLOP/s, size or time that is not a
            positive finite number (times may be 0), or an unknown precision.
    """

    name: str
    memory_bandwidth: float
    matmul_flops: Mapping[str, float]
    vector_flops: float | None = None
    min_kernel_time: float = DEFAULT_MIN_KERNEL_TIME
    memory_capacity: float | None = None
    sm_count: int | None = None
    l2_bytes: float | None = None
    l1_bytes_per_sm: float | None = None
    nvlink_bandwidth: float | None = None
    nvlink_latency: float = DEFAULT_NVLINK_LATENCY
    network_bandwidth: float = DEFAULT_NETWORK_BANDWIDTH
    network_latency: float = DEFAULT_NETWORK_LATENCY
    host_link: str = "PCIe Gen5 x16"
    host_link_bandwidth: float = 64 * GB
    host_link_latency: float = DEFAULT_HOST_LINK_LATENCY
    source: str = "user-defined"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"HardwareSpec: `name` must be a non-empty str, got {self.name!r}")
        positive = ["memory_bandwidth", "network_bandwidth", "host_link_bandwidth"]
        optional = ["vector_flops", "memory_capacity", "sm_count", "l2_bytes"]
        optional += ["l1_bytes_per_sm", "nvlink_bandwidth"]
        times = ["min_kernel_time", "nvlink_latency", "network_latency", "host_link_latency"]
        for field in positive + optional:
            value = getattr(self, field)
            if value is None and field in optional:
                continue
            _check_number(f"HardwareSpec({self.name}): `{field}`", value, allow_zero=False)
        for field in times:
            _check_number(f"HardwareSpec({self.name}): `{field}`", getattr(self, field))
        if self.sm_count is not None and not isinstance(self.sm_count, int):
            raise ValueError(
                f"HardwareSpec({self.name}): `sm_count` must be a positive int, "
                f"got {self.sm_count!r}"
            )
        for field in ("host_link", "source"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(
                    f"HardwareSpec({self.name}): `{field}` must be a str, "
                    f"got {getattr(self, field)!r}"
                )
        if not isinstance(self.matmul_flops, Mapping) or not self.matmul_flops:
            raise ValueError(
                f"HardwareSpec({self.name}): `matmul_flops` must map precisions to FLOP/s, "
                f"got {self.matmul_flops!r}"
            )
        for precision, value in self.matmul_flops.items():
            if precision not in PRECISIONS:
                raise ValueError(
                    f"HardwareSpec({self.name}): `matmul_flops` keys must be in {PRECISIONS}, "
                    f"got {precision!r}"
                )
            _check_number(f"HardwareSpec({self.name}): `matmul_flops[{precision!r}]`", value, False)

    @classmethod
    def custom(
        cls,
        name: str,
        *,
        memory_bandwidth: float,
        flops: float,
        min_kernel_time: float = 0.0,
        **fields: Any,
    ) -> HardwareSpec:
        """A user-defined GPU with one FLOP/s rate for every precision and for elementwise
        work: ``HardwareSpec.custom("toy", memory_bandwidth=2.4e12, flops=800e12,
        min_kernel_time=10e-6)``. ``fields`` sets any other field (links, latencies)."""
        _check_number(f"HardwareSpec({name}): `flops`", flops, allow_zero=False)
        peaks = {precision: flops for precision in PRECISIONS}
        return cls(
            name=name,
            memory_bandwidth=memory_bandwidth,
            matmul_flops=peaks,
            vector_flops=flops,
            min_kernel_time=min_kernel_time,
            **fields,
        )

    def peak(self, precision: str) -> float:
        """Dense tensor-core FLOP/s in ``precision`` ("bf16", "tf32" or "fp32").

        Raises:
            ValueError: this spec has no peak for ``precision``.
        """
        if precision not in self.matmul_flops:
            raise ValueError(
                f"HardwareSpec({self.name}): no matmul peak for precision {precision!r}; "
                f"known: {sorted(self.matmul_flops)}"
            )
        return self.matmul_flops[precision]

    @property
    def elementwise_flops(self) -> float:
        """FLOP/s for elementwise work and reductions (CUDA cores)."""
        if self.vector_flops is not None:
            return self.vector_flops
        return self.matmul_flops.get("fp32", min(self.matmul_flops.values()))

    def replace(self, **changes: Any) -> HardwareSpec:
        return dataclasses.replace(self, **changes)


def _check_number(what: str, value: float, allow_zero: bool = True) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        expected = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{what} must be {expected} finite number, got {value!r}")


_HOPPER_WHITEPAPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (SMs, L2, L1/shared)"

# Ordered from the most specific name to the least, because ``lookup`` matches by substring of
# ``torch.cuda.get_device_name()`` ("H100 PCIe" must win over "H100", "A100" over "A10").
HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in [
        HardwareSpec(
            name="H100 PCIe",
            memory_bandwidth=2.0 * TB,
            matmul_flops={
                "bf16": 756.0 * TFLOPS,
                "tf32": 378.0 * TFLOPS,
                "fp32": 51.2 * TFLOPS,
                "int8": 1513.0 * TFLOPS,
            },
            memory_capacity=80 * GB,
            sm_count=114,
            l2_bytes=50e6,
            l1_bytes_per_sm=256e3,
            nvlink_bandwidth=600 * GB / 2,  # NVLink bridge, 600 GB/s both directions
            source="NVIDIA H100 Tensor Core GPU datasheet (PCIe column); " + _HOPPER_WHITEPAPER,
        ),
        HardwareSpec(
            name="H100 NVL",
            memory_bandwidth=3.9 * TB,
            matmul_flops={
                "bf16": 835.0 * TFLOPS,
                "tf32": 417.5 * TFLOPS,
                "fp32": 60.0 * TFLOPS,
                "int8": 1670.0 * TFLOPS,
            },
            memory_capacity=94 * GB,
            nvlink_bandwidth=600 * GB / 2,
            source="NVIDIA H100 Tensor Core GPU datasheet (H100 NVL column)",
        ),
        HardwareSpec(
            name="H100",  # SXM5, e.g. "NVIDIA H100 80GB HBM3"
            memory_bandwidth=3.35 * TB,
            matmul_flops={
                "bf16": 989.4 * TFLOPS,
                "tf32": 494.7 * TFLOPS,
                "fp32": 66.9 * TFLOPS,
                "int8": 1979.0 * TFLOPS,
            },
            memory_capacity=80 * GB,
            sm_count=132,
            l2_bytes=50e6,
            l1_bytes_per_sm=256e3,
            nvlink_bandwidth=900 * GB / 2,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM column); " + _HOPPER_WHITEPAPER,
        ),
        HardwareSpec(
            name="H200",  # SXM
            memory_bandwidth=4.8 * TB,
            matmul_flops={
                "bf16": 989.4 * TFLOPS,
                "tf32": 494.7 * TFLOPS,
                "fp32": 66.9 * TFLOPS,
                "int8": 1979.0 * TFLOPS,
            },
            memory_capacity=141 * GB,
            sm_count=132,
            l2_bytes=50e6,
            l1_bytes_per_sm=256e3,
            nvlink_bandwidth=900 * GB / 2,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM column); " + _HOPPER_WHITEPAPER,
        ),
        HardwareSpec(
            name="B200",  # HGX B200's per-GPU figures (the HGX totals divided by 8)
            memory_bandwidth=8.0 * TB,
            matmul_flops={"bf16": 2250.0 * TFLOPS, "tf32": 1125.0 * TFLOPS, "fp32": 75.0 * TFLOPS},
            memory_capacity=180 * GB,
            nvlink_bandwidth=1800 * GB / 2,  # NVLink 5
            source="NVIDIA HGX B200 datasheet (per-GPU = platform / 8); SMs, L2, L1 not stated",
        ),
        HardwareSpec(
            name="A100",  # SXM4 80GB
            memory_bandwidth=2.039 * TB,
            matmul_flops={
                "bf16": 312.0 * TFLOPS,
                "tf32": 156.0 * TFLOPS,
                "fp32": 19.5 * TFLOPS,
                "int8": 624.0 * TFLOPS,
            },
            memory_capacity=80 * GB,
            sm_count=108,
            l2_bytes=40e6,
            l1_bytes_per_sm=192e3,
            nvlink_bandwidth=600 * GB / 2,
            network_bandwidth=25 * GB,  # one 200 Gb/s HDR NIC per GPU (DGX A100)
            host_link="PCIe Gen4 x16",
            host_link_bandwidth=32 * GB,
            source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column); NVIDIA A100 Tensor "
            "Core GPU Architecture whitepaper (SMs, L2, L1/shared)",
        ),
        HardwareSpec(
            name="A10",
            memory_bandwidth=600 * GB,
            matmul_flops={
                "bf16": 125.0 * TFLOPS,
                "tf32": 62.5 * TFLOPS,
                "fp32": 31.2 * TFLOPS,
                "int8": 250.0 * TFLOPS,
            },
            memory_capacity=24 * GB,
            sm_count=72,
            l2_bytes=6e6,
            l1_bytes_per_sm=128e3,
            network_bandwidth=25 * GB,
            host_link="PCIe Gen4 x16",
            host_link_bandwidth=32 * GB,
            source="NVIDIA A10 Tensor Core GPU datasheet; NVIDIA Ampere GA102 GPU Architecture "
            "whitepaper (SMs, L2, L1/shared)",
        ),
    ]
}


def lookup(name: str) -> HardwareSpec:
    """The built-in spec whose name is ``name`` or occurs in it, case-insensitive:
    ``lookup("h100")``, ``lookup("NVIDIA H100 80GB HBM3")``.

    Raises:
        ValueError: no built-in spec matches.
    """
    spec = find(name)
    if spec is None:
        raise ValueError(f"lookup: `name` {name!r} matches none of {list(HARDWARE)}")
    return spec


def find(name: str) -> HardwareSpec | None:
    """Like :func:`lookup`, but None when nothing matches."""
    for key, spec in HARDWARE.items():
        if key.lower() == name.lower():
            return spec
    for key, spec in HARDWARE.items():  # the more specific names come first
        if key.lower() in name.lower():
            return spec
    return None
