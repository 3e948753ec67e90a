"""Tile tables of the attention kernels: the launch geometry of each kernel by head dim and
dtype, measured on an H100 (DECISIONS.md), as kernels-int8 and kernels-moe keep theirs."""

from __future__ import annotations

import dataclasses

import torch

from llmsys.triton_launch import cdiv, next_power_of_2


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One kernel's launch geometry: BLOCK_M query rows by BLOCK_N key rows per tile.

    ``head_major``: hand out all tiles of one (batch, head) before the next head (the programs
    in flight share that head's inputs in L2) instead of one tile of every head at a time.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    head_major: bool = False


def block_d(head_dim: int) -> int:
    """``head_dim`` padded to a power of two of at least 16 (``tl.dot``'s smallest K)."""
    return max(16, next_power_of_2(head_dim))


# (forward, dK/dV, dQ) by padded head dim, for 16-bit inputs. Candidates were compiled for sm_90
# first (registers, spills, shared memory; an H100 block gets at most 227 KiB) and then timed on an
# H100 at 1x16x16384x{32,64} and 4x16x4096x128, causal bf16 (a script since removed); the fastest
# of each kernel is here (DECISIONS.md). d = 16 uses d = 32's tiles.
_CONFIGS_16BIT = {
    16: (TileConfig(128, 128, 4, 3), TileConfig(32, 128, 4, 3), TileConfig(64, 64, 4, 3)),
    32: (TileConfig(128, 128, 4, 3), TileConfig(32, 128, 4, 3), TileConfig(64, 64, 4, 3)),
    64: (
        TileConfig(128, 64, 4, 3),
        TileConfig(64, 64, 4, 3, head_major=True),
        TileConfig(64, 64, 4, 3),
    ),
    128: (
        TileConfig(128, 64, 8, 3, head_major=True),
        TileConfig(32, 64, 4, 3),
        TileConfig(64, 64, 4, 2, head_major=True),
    ),
    256: (TileConfig(64, 64, 8, 2), TileConfig(16, 32, 4, 2), TileConfig(64, 32, 8, 2)),
}
# float32 tiles take twice the registers and shared memory: smaller tiles, fewer stages.
_CONFIGS_32BIT = {
    16: (TileConfig(64, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 32, 4, 3)),
    32: (TileConfig(64, 64, 4, 3), TileConfig(32, 64, 4, 3), TileConfig(64, 32, 4, 3)),
    64: (TileConfig(64, 64, 4, 3), TileConfig(16, 64, 4, 2), TileConfig(64, 32, 4, 2)),
    128: (TileConfig(64, 32, 4, 2), TileConfig(16, 32, 4, 2), TileConfig(64, 32, 8, 2)),
    256: (TileConfig(32, 32, 4, 2), TileConfig(16, 32, 4, 2), TileConfig(32, 16, 4, 2)),
}


# The TMA forward's tile (16-bit, head dim 128): 128 x 128 with 8 warps and 3 stages was the
# fastest of four on an H100 (DECISIONS.md); warp specialisation (tl.range(warp_specialize=True))
# measured no faster and fails to compile at 4 warps on triton 3.6.
TMA_TILE = TileConfig(128, 128, 8, 3)


def tile_configs(head_dim: int, dtype: torch.dtype) -> tuple[TileConfig, TileConfig, TileConfig]:
    """(forward, dK/dV, dQ) tile configurations for this head dim and dtype."""
    table = _CONFIGS_32BIT if dtype == torch.float32 else _CONFIGS_16BIT
    return table[block_d(head_dim)]


# H100, 4x32x8192x128 bf16: the TMA forward 574 / 566 TFLOP/s causal / not, the pointer forward
# 489 / 505 (DECISIONS.md). At head dim 64 it was slower in all eight cases measured three times
# each (3-17%; 1x16x16384 causal 384 against 415).
TMA_HEAD_DIMS = (128,)
# The TMA forward from this much work (2 * B * H * N_q * N_k * d, the causal count): about
# 100 us of kernel at 500 TFLOP/s. Below it the descriptors' host cost showed: 1x32x1024x128
# causal (8.6 GFLOP) took 61-91 us of host time per call against SDPA's 22-31 (H100).
TMA_MIN_FLOPS = 5e10


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's launch geometry: each program reads ``chunk`` keys of one kv head
    (``block_n`` per step); a cache of capacity C is split into ``ceil(C / chunk)`` programs per
    (sequence, kv head)."""

    chunk: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# A first guess (issue 46 asks for the GPU sweep): at most 256 keys per program, so that a 4k
# cache gives 16 splits per (sequence, kv head) and the combine pass reads a few percent of the
# KV bytes. float32 (tests) takes smaller key tiles. `decode_chunk` halves the chunk for small
# grids.
_DECODE_16BIT = DecodeConfig(chunk=256, block_n=64)
_DECODE_32BIT = DecodeConfig(chunk=256, block_n=32)
# Programs per SM below which the chunk is halved. The first H100 run (benchmarks/decode.py,
# batch 1, 8 kv heads) read 70% of copy bandwidth at context 32768 (1,024 programs) and 8% at
# 1024 (32 programs on 132 SMs): a small grid leaves most SMs idle.
DECODE_PROGRAMS_PER_SM = 2


def decode_config(head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The decode kernel's largest chunk and key tile for this head dim and dtype."""
    return _DECODE_32BIT if dtype == torch.float32 else _DECODE_16BIT


def decode_chunk(config: DecodeConfig, capacity: int, programs_per_split: int, sms: int) -> int:
    """Keys per program: ``config.chunk``, halved (down to ``config.block_n``) while the grid,
    ``ceil(capacity / chunk)`` splits times ``programs_per_split``, has fewer than
    ``DECODE_PROGRAMS_PER_SM`` programs for each of the ``sms`` SMs."""
    chunk = config.chunk
    while chunk > config.block_n and (
        cdiv(capacity, chunk) * programs_per_split < DECODE_PROGRAMS_PER_SM * sms
    ):
        chunk //= 2
    return chunk
