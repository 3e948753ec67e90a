"""Triton kernels of the routing: the padded row of every (token, k) pair, on the GPU.

Pairs are numbered ``p = token * topk + k``; the row of a pair is a stable counting sort by
expert:

    start[e] = sum_{e' < e} ceil(tokens_per_expert[e'] / align) * align
    rank(p)  = #{p' < p : expert(p') == expert(p)}          (so tokens stay in ascending order)
    row(p)   = start[expert(p)] + rank(p)

computed in two passes over blocks of pairs, as a radix sort's counting pass does:

    moe_count_kernel            block b: counts[b, e], and each pair's rank inside its block
    moe_layout_kernel           tile of experts: start[e], and the base row of each (block, expert)
                                base[b, e] = start[e] + sum_{b' < b} counts[b', e]
    moe_route_one_block_kernel  both at once, in one program, when every pair fits one block

so that ``row(p) = base[block(p), expert(p)] + rank_in_block(p)``, which the copy kernels
(kernels.py) compute for each pair. The kernels also write ``status``: the total row count, the
number of pairs with bad expert ids and, per tile of experts, how many experts' counts disagree
with the ids; the exact-rows path reads it back with its one host sync. Nothing here waits on
the host.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _padded(count, align):
    return (count + align - 1) // align * align


@triton.jit
def _clamped(given, n_pairs):
    """Counts clamped to [0, n_pairs], so that bad counts cannot overflow the row arithmetic."""
    return tl.minimum(tl.maximum(given, 0), n_pairs).to(tl.int32)


@triton.jit
def _rows_before(tpe_ptr, expert0, n_pairs, align, ET: tl.constexpr):
    """Padded rows of all experts before ``expert0`` (a scalar)."""
    acc = tl.zeros([ET], dtype=tl.int32)
    for e0 in range(0, expert0, ET):
        experts = e0 + tl.arange(0, ET)
        given = tl.load(tpe_ptr + experts, mask=experts < expert0, other=0)
        acc += _padded(_clamped(given, n_pairs), align)
    return tl.sum(acc, axis=0)


@triton.jit
def _count_pass(
    experts_ptr,
    rank_ptr,
    first_pair,
    n_in_block,
    n_pairs,
    num_experts,
    expert0,
    ET: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Ranks, inside the block, of the block's pairs whose expert is in [expert0, expert0 + ET).

    Walks the block CHUNK pairs at a time; a (CHUNK, ET) one-hot matrix and its running sum down
    the pairs give each pair's rank. Returns (pairs per expert of the tile, pairs with bad ids).
    """
    tile = expert0 + tl.arange(0, ET)
    seen = tl.zeros([ET], dtype=tl.int32)
    invalid = tl.zeros([CHUNK], dtype=tl.int32)
    for c in range(0, n_in_block, CHUNK):
        local = c + tl.arange(0, CHUNK)
        pair = first_pair + local
        live = (local < n_in_block) & (pair < n_pairs)
        expert = tl.load(experts_ptr + pair, mask=live, other=0)
        valid = live & (expert >= 0) & (expert < num_experts)
        invalid += (live & ~valid).to(tl.int32)
        onehot = ((expert[:, None] == tile[None, :]) & valid[:, None]).to(tl.int32)  # (CHUNK, ET)
        earlier = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs before each, in chunk
        rank = tl.sum(onehot * (earlier + seen[None, :]), axis=1)  # (CHUNK,)
        in_tile = valid & (expert >= expert0) & (expert < expert0 + ET)
        tl.store(rank_ptr + pair, rank, mask=in_tile)
        seen += tl.sum(onehot, axis=0)
    return seen, tl.sum(invalid, axis=0)


@triton.jit
def _store_tile_layout(
    padded_ptr,
    start_ptr,
    limit_ptr,
    status_ptr,
    experts,
    valid,
    given,
    n_pairs,
    start,
    padded,
    seen,
    tile_index,
):
    """Store a tile's padded counts, first rows, data-row limits and its count of mismatches."""
    tl.store(padded_ptr + experts, padded, mask=valid)
    tl.store(start_ptr + experts, start, mask=valid)
    # Rows [start, start + limit) hold data, the rest of the expert's rows are padding. When the
    # counts disagree with top_experts (unchecked on the out_rows path) this keeps both sound.
    tl.store(limit_ptr + experts, tl.minimum(seen, _clamped(given, n_pairs)), mask=valid)
    mismatches = tl.sum((valid & (seen != given)).to(tl.int32), axis=0)
    tl.store(status_ptr + 2 + tile_index, mismatches)


@triton.jit
def moe_route_one_block_kernel(
    # pointers
    experts_ptr,  # (n_pairs,) int: top_experts, flattened
    tpe_ptr,  # (num_experts,) int: tokens_per_expert
    rank_ptr,  # (n_pairs,) int32 out: rank of each pair among its expert's pairs
    base_ptr,  # (num_experts + 1,) int32 out: the block's base row per expert (= start)
    padded_ptr,  # (num_experts,) out: padded tokens per expert
    start_ptr,  # (num_experts + 1,) int32 out: first row of each expert; [num_experts] = total
    limit_ptr,  # (num_experts,) int32 out: data rows of each expert
    status_ptr,  # (2 + n_tiles,) int32 out: total rows, bad ids, mismatches per expert tile
    # sizes
    n_pairs,
    num_experts,
    align,
    # meta-parameters
    ET: tl.constexpr,
    CHUNK: tl.constexpr,
):
    for expert0 in range(0, num_experts, ET):
        experts = expert0 + tl.arange(0, ET)
        valid = experts < num_experts
        given = tl.load(tpe_ptr + experts, mask=valid, other=0)  # issued before the counting
        before = _rows_before(tpe_ptr, expert0, n_pairs, align, ET)
        seen, invalid = _count_pass(
            experts_ptr, rank_ptr, 0, n_pairs, n_pairs, num_experts, expert0, ET, CHUNK
        )
        padded = _padded(_clamped(given, n_pairs), align)
        start = before + tl.cumsum(padded, axis=0) - padded
        tl.store(base_ptr + experts, start, mask=valid)
        _store_tile_layout(
            padded_ptr, start_ptr, limit_ptr, status_ptr, experts, valid, given, n_pairs,
            start, padded, seen, expert0 // ET,
        )  # fmt: skip
        tl.store(status_ptr + 1, invalid)
        if expert0 + ET >= num_experts:
            total = before + tl.sum(padded, axis=0)
            tl.store(start_ptr + num_experts, total)
            tl.store(status_ptr, total)


@triton.jit
def moe_count_kernel(
    # pointers
    experts_ptr,  # (n_pairs,) int: top_experts, flattened
    rank_ptr,  # (n_pairs,) int32 out: rank of each pair among its block's pairs of its expert
    counts_ptr,  # (n_blocks, num_experts + 1) int32 out: pairs per expert; last column bad ids
    # sizes
    n_pairs,
    num_experts,
    pairs_per_block,
    # meta-parameters
    ET: tl.constexpr,
    CHUNK: tl.constexpr,
):
    block = tl.program_id(0)
    counts = counts_ptr + block * (num_experts + 1)
    for expert0 in range(0, num_experts, ET):
        seen, invalid = _count_pass(
            experts_ptr, rank_ptr, block * pairs_per_block, pairs_per_block, n_pairs,
            num_experts, expert0, ET, CHUNK,
        )  # fmt: skip
        experts = expert0 + tl.arange(0, ET)
        tl.store(counts + experts, seen, mask=experts < num_experts)
        tl.store(counts + num_experts, invalid)


@triton.jit
def moe_layout_kernel(
    # pointers
    counts_ptr,  # (n_blocks, num_experts + 1) int32 in: counts; out: base rows
    tpe_ptr,  # (num_experts,) int: tokens_per_expert
    padded_ptr,  # (num_experts,) out: padded tokens per expert
    start_ptr,  # (num_experts + 1,) int32 out: first row of each expert; [num_experts] = total
    limit_ptr,  # (num_experts,) int32 out: data rows of each expert
    status_ptr,  # (2 + n_tiles,) int32 out: total rows, bad ids, mismatches per expert tile
    # sizes
    n_blocks,
    n_pairs,
    num_experts,
    align,
    # meta-parameters
    ET: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    tile = tl.program_id(0)
    expert0 = tile * ET
    experts = expert0 + tl.arange(0, ET)
    valid = experts < num_experts
    given = tl.load(tpe_ptr + experts, mask=valid, other=0)
    before = _rows_before(tpe_ptr, expert0, n_pairs, align, ET)
    padded = _padded(_clamped(given, n_pairs), align)
    start = before + tl.cumsum(padded, axis=0) - padded
    seen = tl.zeros([ET], dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCKS):
        blocks = b0 + tl.arange(0, BLOCKS)
        ptrs = counts_ptr + blocks[:, None] * (num_experts + 1) + experts[None, :]
        mask = (blocks < n_blocks)[:, None] & valid[None, :]
        counts = tl.load(ptrs, mask=mask, other=0)  # (BLOCKS, ET)
        base = start[None, :] + seen[None, :] + tl.cumsum(counts, axis=0) - counts
        tl.store(ptrs, base, mask=mask)
        seen += tl.sum(counts, axis=0)
    _store_tile_layout(
        padded_ptr, start_ptr, limit_ptr, status_ptr, experts, valid, given, n_pairs,
        start, padded, seen, tile,
    )  # fmt: skip
    if tile == 0:
        invalid = tl.zeros([BLOCKS], dtype=tl.int32)
        for b0 in range(0, n_blocks, BLOCKS):
            blocks = b0 + tl.arange(0, BLOCKS)
            column = counts_ptr + blocks * (num_experts + 1) + num_experts
            invalid += tl.load(column, mask=blocks < n_blocks, other=0)
        tl.store(status_ptr + 1, tl.sum(invalid, axis=0))
    if tile == tl.num_programs(0) - 1:
        total = before + tl.sum(padded, axis=0)
        tl.store(start_ptr + num_experts, total)
        tl.store(status_ptr, total)
