"""Collective times with the alpha-beta model: ``steps * alpha + bytes_on_the_wire / beta``.

``alpha`` is a link's latency per step and ``beta`` its bandwidth per GPU and direction
(``HardwareSpec``'s NVLink or network fields). ``nbytes`` is always the full tensor: the
all-reduce's buffer, the all-gather's output, the reduce-scatter's input, the broadcast's
buffer. With ``n`` ranks:

======================  =======================  =====================================
collective              ring                     tree
======================  =======================  =====================================
all-reduce              2(n-1) a + 2(n-1)/n S/b  2 ceil(log2 n) a + 2 S/b
all-gather              (n-1) a + (n-1)/n S/b    ceil(log2 n) a + (n-1)/n S/b
reduce-scatter          (n-1) a + (n-1)/n S/b    ceil(log2 n) a + (n-1)/n S/b
broadcast               (n-1) a + S/b            ceil(log2 n) (a + S/b)
======================  =======================  =====================================

The ring all-reduce is a reduce-scatter then an all-gather; the tree all-reduce reduces up a
pipelined binary tree and broadcasts down it; tree all-gather / reduce-scatter are recursive
doubling / halving; the ring broadcast is pipelined along a chain. Reduction arithmetic is not
counted (it hides under the transfer).

Hierarchical collectives over ``nodes x gpus_per_node`` ranks (FSDP over all GPUs, or HSDP's
inter-node replica groups) run NVLink inside a node and the network between nodes, each GPU
using its own NIC: all-reduce = reduce-scatter in the node, all-reduce of ``S / gpus_per_node``
between nodes, all-gather in the node; all-gather = all-gather of ``S / gpus_per_node``
between nodes, then in the node (reduce-scatter is its mirror); broadcast = between nodes,
then in the node.
"""

from __future__ import annotations

import dataclasses
import math

from .hardware import HardwareSpec

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "broadcast")
ALGORITHMS = ("ring", "tree")


@dataclasses.dataclass(frozen=True)
class Link:
    """One level of interconnect: ``latency`` seconds per step, ``bandwidth`` bytes/s per GPU
    and direction."""

    name: str
    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not _finite_number(self.latency) or self.latency < 0:
            raise ValueError(
                f"Link({self.name}): `latency` must be a finite number >= 0, got {self.latency!r}"
            )
        if not _finite_number(self.bandwidth) or self.bandwidth <= 0:
            raise ValueError(
                f"Link({self.name}): `bandwidth` must be a finite number > 0, "
                f"got {self.bandwidth!r}"
            )


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def intra_node_link(hw: HardwareSpec) -> Link:
    """NVLink when the GPU has it, else the host link (PCIe through the CPU)."""
    if hw.nvlink_bandwidth is not None:
        return Link("NVLink", hw.nvlink_latency, hw.nvlink_bandwidth)
    return Link(hw.host_link, hw.host_link_latency, hw.host_link_bandwidth)


def network_link(hw: HardwareSpec) -> Link:
    """The between-node network, one NIC per GPU."""
    return Link("network", hw.network_latency, hw.network_bandwidth)


def flat_time(
    collective: str, nbytes: float, ranks: int, link: Link, algorithm: str = "ring"
) -> float:
    """Seconds for one collective over ``ranks`` GPUs that all talk over ``link``.

    Args:
        collective: "all-reduce", "all-gather", "reduce-scatter" or "broadcast".
        nbytes: the full tensor in bytes (see the module docstring).
        ranks: participating GPUs (1 costs nothing).
        link: latency and bandwidth of every hop.
        algorithm: "ring" or "tree". Default "ring".
    """
    _check(collective, nbytes, ranks, algorithm)
    n, a, b, s = ranks, link.latency, link.bandwidth, nbytes
    if n == 1:
        return 0.0
    depth = math.ceil(math.log2(n))
    if algorithm == "ring":
        return {
            "all-reduce": 2 * (n - 1) * a + 2 * (n - 1) / n * s / b,
            "all-gather": (n - 1) * a + (n - 1) / n * s / b,
            "reduce-scatter": (n - 1) * a + (n - 1) / n * s / b,
            "broadcast": (n - 1) * a + s / b,
        }[collective]
    return {
        "all-reduce": 2 * depth * a + 2 * s / b,
        "all-gather": depth * a + (n - 1) / n * s / b,
        "reduce-scatter": depth * a + (n - 1) / n * s / b,
        "broadcast": depth * (a + s / b),
    }[collective]


def collective_time(
    collective: str,
    nbytes: float,
    hw: HardwareSpec,
    *,
    gpus_per_node: int,
    nodes: int = 1,
    algorithm: str = "ring",
) -> float:
    """Seconds for one collective over ``nodes * gpus_per_node`` GPUs of kind ``hw``:
    flat over NVLink inside one node, hierarchical (NVLink, then the network) across nodes.

    Args:
        collective: "all-reduce", "all-gather", "reduce-scatter" or "broadcast".
        nbytes: the full tensor in bytes.
        hw: the GPU and its links.
        gpus_per_node: ranks per node.
        nodes: nodes. Default 1.
        algorithm: "ring" or "tree", used at each level. Default "ring".
    """
    for name, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"collective_time: `{name}` must be a positive int, got {value!r}")
    _check(collective, nbytes, gpus_per_node * nodes, algorithm)
    inside, between = intra_node_link(hw), network_link(hw)
    g = gpus_per_node
    if nodes == 1:
        return flat_time(collective, nbytes, g, inside, algorithm)
    if collective == "all-reduce":
        return (
            flat_time("reduce-scatter", nbytes, g, inside, algorithm)
            + flat_time("all-reduce", nbytes / g, nodes, between, algorithm)
            + flat_time("all-gather", nbytes, g, inside, algorithm)
        )
    if collective == "broadcast":
        return flat_time("broadcast", nbytes, nodes, between, algorithm) + flat_time(
            "broadcast", nbytes, g, inside, algorithm
        )
    # all-gather / reduce-scatter: the between-node part moves each node-local shard group
    return flat_time(collective, nbytes / g, nodes, between, algorithm) + flat_time(
        collective, nbytes, g, inside, algorithm
    )


def bus_bandwidth(collective: str, nbytes: float, ranks: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth in bytes/s: the algorithm bandwidth ``nbytes / seconds``
    times ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather and reduce-scatter, 1 for
    broadcast; comparable to a link's bandwidth whatever the rank count."""
    _check(collective, nbytes, ranks, "ring")
    factor = {"all-reduce": 2 * (ranks - 1) / ranks, "broadcast": 1.0}.get(
        collective, (ranks - 1) / ranks
    )
    return nbytes / seconds * factor


def _check(collective: str, nbytes: float, ranks: int, algorithm: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"`collective` must be one of {COLLECTIVES}, got {collective!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"`algorithm` must be one of {ALGORITHMS}, got {algorithm!r}")
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"`ranks` must be a positive int, got {ranks!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) or nbytes < 0:
        raise ValueError(f"`nbytes` must be a non-negative number, got {nbytes!r}")
