"""Roofline costs of single ops: FLOPs, bytes moved, time, and what bounds the time.

Conventions (the ones the worked examples in the README follow):

- FLOPs count 2 per multiply-add; an elementwise op counts ``flops_per_element`` per output.
- Bytes are the minimum traffic to and from device memory: every input read once and every
  output written once, in the op's dtype (a matmul ``x @ W`` reads x and W and writes y).
  Scalars (``x / d`` with a Python float) cost nothing. Caches are assumed to hold any reuse.
- One kernel per op, and its time is ``max(flops / peak, bytes / bandwidth, min_kernel_time)``:
  compute and memory traffic overlap perfectly, and no kernel is shorter than a launch.
- The op is "compute", "memory" or "launch" bound by which of the three terms is the max.
- Arithmetic intensity is FLOPs per byte moved.

Matmuls run on tensor cores at ``hw.peak(precision)``; elementwise ops and reductions on the
CUDA cores at ``hw.elementwise_flops``. Times are seconds, sizes bytes, rates per second.
"""

from __future__ import annotations

import dataclasses
import math

from .hardware import HardwareSpec

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
# precision whose tensor-core peak a matmul in this dtype runs at (fp32 without TF32: "fp32")
MATMUL_PRECISION = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "bf16"}


@dataclasses.dataclass(frozen=True)
class OpCost:
    """The roofline cost of one kernel.

    Attributes:
        name: what the op is ("linear 512x4096 -> 8192").
        flops: floating-point operations.
        bytes: bytes read from and written to device memory.
        compute_time, memory_time: ``flops / peak`` and ``bytes / bandwidth``, seconds.
        min_time: the hardware's minimum kernel time, seconds.
    """

    name: str
    flops: float
    bytes: float
    compute_time: float
    memory_time: float
    min_time: float

    @property
    def time(self) -> float:
        """Predicted seconds: the largest of the compute, memory and minimum kernel times."""
        return max(self.compute_time, self.memory_time, self.min_time)

    @property
    def bound(self) -> str:
        """ "compute", "memory" or "launch": which term sets :attr:`time`."""
        if self.min_time >= max(self.compute_time, self.memory_time):
            return "launch"
        return "compute" if self.compute_time >= self.memory_time else "memory"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte (inf for an op that moves no bytes)."""
        return self.flops / self.bytes if self.bytes else math.inf


def total_time(costs: list[OpCost]) -> float:
    """Seconds for ops run one after another (no overlap between kernels)."""
    return sum(cost.time for cost in costs)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"`dtype` must be one of {list(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative number, got {value!r}")


def _cost(name: str, flops: float, nbytes: float, flop_rate: float, hw: HardwareSpec) -> OpCost:
    return OpCost(
        name=name,
        flops=flops,
        bytes=nbytes,
        compute_time=flops / flop_rate,
        memory_time=nbytes / hw.memory_bandwidth,
        min_time=hw.min_kernel_time,
    )


def matmul(m: int, n: int, k: int, hw: HardwareSpec, dtype: str = "bf16") -> OpCost:
    """``C = A @ B`` with A (m, k), B (k, n), C (m, n), all in ``dtype``.

    Args:
        m, n, k: the sizes above (elements).
        hw: the GPU.
        dtype: element type of A, B and C; fp32 runs at the fp32 peak (pass "tf32" for
            TF32 matmuls, stored as 4 bytes). Default "bf16".

    Returns:
        :class:`OpCost` with ``2 m n k`` FLOPs and ``(m k + k n + m n) * bytes(dtype)`` bytes.
    """
    for name, value in (("m", m), ("n", n), ("k", k)):
        _count(name, value)
    if dtype not in MATMUL_PRECISION:
        raise ValueError(f"matmul: `dtype` must be one of {list(MATMUL_PRECISION)}, got {dtype!r}")
    nbytes = (m * k + k * n + m * n) * dtype_bytes(dtype)
    peak = hw.peak(MATMUL_PRECISION[dtype])
    return _cost(f"matmul {m}x{k} @ {k}x{n} {dtype}", 2.0 * m * n * k, nbytes, peak, hw)


def linear(
    tokens: int, in_features: int, out_features: int, hw: HardwareSpec, dtype: str = "bf16"
) -> OpCost:
    """``y = x @ W.T`` (no bias) for x (tokens, in_features), W (out_features, in_features).

    Args:
        tokens: rows of x (batch times sequence length).
        in_features, out_features: the layer's widths.
        hw: the GPU.
        dtype: element type of x, W and y. Default "bf16".

    Returns:
        :func:`matmul` ``(m=tokens, n=out_features, k=in_features)`` under a linear's name.
    """
    cost = matmul(tokens, out_features, in_features, hw, dtype)
    name = f"linear {tokens}x{in_features} -> {out_features} {dtype}"
    return dataclasses.replace(cost, name=name)


def elementwise(
    num_elements: int,
    hw: HardwareSpec,
    dtype: str = "bf16",
    *,
    inputs: int = 1,
    outputs: int = 1,
    flops_per_element: float = 1.0,
    name: str = "elementwise",
) -> OpCost:
    """An elementwise op over ``num_elements`` elements: ``x / d`` (1 input; a scalar d is
    free), ``a + b`` (2 inputs), ``gelu(x)`` (1 input, ~10 FLOPs).

    Args:
        num_elements: elements of each tensor operand (no broadcasting).
        hw: the GPU.
        dtype: element type of every operand. Default "bf16".
        inputs: tensors read. Default 1.
        outputs: tensors written. Default 1.
        flops_per_element: FLOPs per output element. Default 1.
        name: label for the cost. Default "elementwise".

    Returns:
        :class:`OpCost` with ``(inputs + outputs) * num_elements * bytes(dtype)`` bytes.
    """
    for arg, value in (("num_elements", num_elements), ("inputs", inputs), ("outputs", outputs)):
        _count(arg, value)
    _count("flops_per_element", flops_per_element)
    nbytes = (inputs + outputs) * num_elements * dtype_bytes(dtype)
    flops = flops_per_element * num_elements * max(outputs, 1)
    return _cost(f"{name} {num_elements} {dtype}", flops, nbytes, hw.elementwise_flops, hw)


def reduction(
    num_elements: int,
    hw: HardwareSpec,
    dtype: str = "bf16",
    *,
    out_elements: int = 1,
    flops_per_element: float = 1.0,
    name: str = "reduction",
) -> OpCost:
    """A reduction (sum, max, norm) of ``num_elements`` inputs to ``out_elements`` outputs
    (1 for a full sum; the row count for a row-wise sum).

    Args:
        num_elements: input elements.
        hw: the GPU.
        dtype: element type of input and output. Default "bf16".
        out_elements: output elements. Default 1.
        flops_per_element: FLOPs per input element (1 for a sum, 2 for a sum of squares).
        name: label for the cost. Default "reduction".

    Returns:
        :class:`OpCost` reading the input once and writing the output once.
    """
    _count("num_elements", num_elements)
    _count("out_elements", out_elements)
    _count("flops_per_element", flops_per_element)
    nbytes = (num_elements + out_elements) * dtype_bytes(dtype)
    flops = flops_per_element * num_elements
    return _cost(f"{name} {num_elements} {dtype}", flops, nbytes, hw.elementwise_flops, hw)


def attention(
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    hw: HardwareSpec,
    dtype: str = "bf16",
    *,
    kv_heads: int | None = None,
    causal: bool = True,
) -> OpCost:
    """A fused (FlashAttention) forward: ``softmax(q k^T / sqrt(d)) v`` without materializing
    the scores, so memory traffic is q, k, v read once and o written once.

    Prefill is ``q_len == kv_len``; decode is ``q_len = 1`` (or a few new tokens) against a
    KV cache of ``kv_len`` tokens, where reading the cache dominates. Causal counts only the
    (query, key) pairs that are needed: a query at position ``i`` of the last ``q_len``
    positions sees ``kv_len - q_len + i + 1`` keys.

    Args:
        batch: sequences.
        heads: query heads.
        q_len: queries per sequence.
        kv_len: keys / values per sequence (the cache length when decoding).
        head_dim: per-head width d.
        hw: the GPU.
        dtype: element type of q, k, v, o. Default "bf16".
        kv_heads: key/value heads (grouped-query attention); default ``heads``.
        causal: mask future keys. Default True.

    Returns:
        :class:`OpCost` with ``4 * batch * heads * pairs * head_dim`` FLOPs (q k^T and p v) and
        ``batch * (2 heads q_len + 2 kv_heads kv_len) * head_dim * bytes(dtype)`` bytes.
    """
    if not isinstance(causal, bool):
        raise TypeError(f"attention: `causal` must be a bool, got {type(causal).__name__}")
    kv_heads = heads if kv_heads is None else kv_heads
    sizes = {"batch": batch, "heads": heads, "q_len": q_len, "kv_len": kv_len}
    sizes |= {"head_dim": head_dim, "kv_heads": kv_heads}
    for arg, value in sizes.items():
        _count(arg, value)
    if q_len > kv_len:
        raise ValueError(f"attention: `q_len` ({q_len}) must be at most `kv_len` ({kv_len})")
    # causal: the sum over i < q_len of (kv_len - q_len + i + 1)
    causal_pairs = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    pairs = causal_pairs if causal else q_len * kv_len
    flops = 4.0 * batch * heads * pairs * head_dim
    nbytes = batch * (2 * heads * q_len + 2 * kv_heads * kv_len) * head_dim * dtype_bytes(dtype)
    peak = hw.peak(MATMUL_PRECISION.get(dtype, "bf16"))
    kind = "decode" if q_len < kv_len else "prefill"
    name = f"attention {kind} b={batch} h={heads} q={q_len} kv={kv_len} d={head_dim} {dtype}"
    return _cost(name, flops, nbytes, peak, hw)


def host_to_device(nbytes: float, hw: HardwareSpec) -> OpCost:
    """A copy of ``nbytes`` bytes from pinned host memory to the GPU over the host link:
    ``max(host_link_latency, nbytes / host_link_bandwidth)`` (pageable memory adds a staging
    copy on the host and is slower). Its ``bound`` is "memory" (the link) or "launch" (the
    latency)."""
    _count("nbytes", nbytes)
    return OpCost(
        name=f"host-to-device {nbytes:.4g} B over {hw.host_link}",
        flops=0.0,
        bytes=nbytes,
        compute_time=0.0,
        memory_time=nbytes / hw.host_link_bandwidth,
        min_time=hw.host_link_latency,
    )
