"""Launch configurations of the routing and copy kernels, each measured on an H100
(DECISIONS.md).
"""

from __future__ import annotations

import dataclasses
import functools

from llmsys.triton_launch import cdiv, next_power_of_2


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    """How the routing passes split the pairs: ``n_blocks == 1`` is the one-program path."""

    chunk: int  # pairs per one-hot tile
    expert_tile: int  # experts per one-hot tile
    pairs_per_block: int
    n_blocks: int
    layout_tile: int  # experts per program of moe_layout_kernel
    num_warps: int = 4  # of moe_count_kernel


# Measured on an H100 (DECISIONS.md): 512 blocks and 16 experts per layout program route
# 16384 x top-8 of 256 experts in 51 us instead of 73 us (256 and 32), and tie elsewhere.
ONE_BLOCK_MAX_STEPS = 4  # one program walks at most this many one-hot tiles
TARGET_BLOCKS = 512  # programs of the count pass
LAYOUT_TILE = 16  # experts per program of the layout pass
COUNT_WARPS = 4


@functools.lru_cache(maxsize=1024)
def route_config(n_pairs: int, num_experts: int) -> RouteConfig:
    expert_tile = min(next_power_of_2(num_experts), 256)
    chunk = max(8192 // expert_tile, 16)  # (chunk, expert_tile) one-hot tiles of 8192 ints
    chunk = min(chunk, max(next_power_of_2(n_pairs), 16))
    steps = cdiv(n_pairs, chunk) * cdiv(num_experts, expert_tile)
    if steps <= ONE_BLOCK_MAX_STEPS:
        return RouteConfig(chunk, expert_tile, max(n_pairs, 1), 1, expert_tile)
    per_block = chunk * cdiv(n_pairs, TARGET_BLOCKS * chunk)
    layout_tile = min(expert_tile, LAYOUT_TILE)
    n_blocks = cdiv(n_pairs, per_block)
    return RouteConfig(chunk, expert_tile, per_block, n_blocks, layout_tile, COUNT_WARPS)


@functools.lru_cache(maxsize=1024)
def copy_config(hidden: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of the row copies: a whole row of up to 16 KB per step.

    Measured on an H100 (DECISIONS.md): from 2 KB to 16 KB per step the configurations
    with 4 or 8 warps are within 3% of each other at hidden 4096 and 7168 in bfloat16 (16 warps
    lose up to 10%); one step per row needs no loop.
    """
    block = min(next_power_of_2(max(hidden, 1)), 16384 // element_size)
    num_warps = min(max(block * element_size // 2048, 4), 8)
    return block, num_warps


@functools.lru_cache(maxsize=1024)
def zero_config(hidden: int, element_size: int) -> tuple[int, int]:
    """(ZERO_ROWS, ZERO_H): rows per zeroing program and columns per store (32 x 512)."""
    return 32, min(next_power_of_2(max(hidden, 1)), 512)
