"""Triton kernels for the padded MoE permute and its inverse.

Routing: the padded row of each (token, k) pair, pairs numbered ``p = token * topk + k``, is a
stable counting sort by expert:

    start[e] = sum_{e' < e} ceil(tokens_per_expert[e'] / align) * align
    rank(p)  = #{p' < p : expert(p') == expert(p)}          (so tokens stay in ascending order)
    row(p)   = start[expert(p)] + rank(p)

computed in two passes over blocks of pairs, as a radix sort's counting pass does:

    moe_count_kernel            block b: counts[b, e], and each pair's rank inside its block
    moe_layout_kernel           tile of experts: start[e], and the base row of each (block, expert)
                                base[b, e] = start[e] + sum_{b' < b} counts[b', e]
    moe_route_one_block_kernel  both at once, in one program, when every pair fits one block

so that ``row(p) = base[block(p), expert(p)] + rank_in_block(p)``. Nothing here waits on the host.

Copies: each program owns one token and reads its row of ``x`` once:

    moe_permute_kernel        out[row(t, k)] = x[t] for every k; the programs past the tokens zero
                              the padding rows (never the whole output)
    moe_unpermute_kernel      y[t] = sum_k w[t, k] * src[row(t, k)], accumulated in float32
    moe_unpermute_bwd_kernel  grad_src[row(t, k)] = w[t, k] * g[t], grad_w[t, k] = <g[t], src[row]>

Row offsets are 64-bit, so outputs past 2**31 elements index correctly. A row of -1 in
``row_index`` marks a dropped pair: it is never read or written.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --- routing -------------------------------------------------------------------------------------


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


# --- copies --------------------------------------------------------------------------------------


@triton.jit
def _pair_row(
    experts_ptr,
    rank_ptr,
    base_ptr,
    start_ptr,
    limit_ptr,
    pair,
    num_experts,
    out_rows,
    pairs_per_block,
):
    """The padded row of one pair, or -1 if it is dropped (bad id, or past its data rows)."""
    expert = tl.load(experts_ptr + pair)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0).to(tl.int32)
    block_base = tl.load(base_ptr + (pair // pairs_per_block) * (num_experts + 1) + expert)
    row = block_base + tl.load(rank_ptr + pair)
    rank = row - tl.load(start_ptr + expert)
    valid = valid & (rank >= 0) & (rank < tl.load(limit_ptr + expert)) & (row < out_rows)
    return tl.where(valid, row, -1)


@triton.jit
def _expert_of_rows(start_ptr, rows, num_experts, SEARCH_STEPS: tl.constexpr):
    """The last e in [0, num_experts] with start[e] <= row, by binary search (num_experts: tail)."""
    lo = tl.zeros_like(rows)
    hi = lo + num_experts + 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        active = hi - lo > 1
        right = active & (tl.load(start_ptr + mid, mask=active, other=0) <= rows)
        lo = tl.where(right, mid, lo)
        hi = tl.where(active & ~right, mid, hi)
    return lo


@triton.jit
def _zero_rows(
    out_ptr, rows, is_pad, hidden, stride_out, ZERO_ROWS: tl.constexpr, ZERO_H: tl.constexpr
):
    if tl.max(is_pad.to(tl.int32), axis=0) > 0:  # most blocks of rows hold no padding at all
        cols = tl.arange(0, ZERO_H)
        zeros = tl.zeros([ZERO_ROWS, ZERO_H], dtype=out_ptr.dtype.element_ty)
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        for h0 in range(0, hidden, ZERO_H):
            tl.store(ptrs + h0, zeros, mask=is_pad[:, None] & (h0 + cols < hidden)[None, :])


@triton.jit
def moe_permute_kernel(
    # pointers
    x_ptr,  # (num_tokens, hidden)
    experts_ptr,  # (num_tokens * TOPK,) int: top_experts, flattened
    rank_ptr,  # (num_tokens * TOPK,) int32: rank of each pair inside its block
    base_ptr,  # (n_blocks, num_experts + 1) int32: base row of each (block, expert)
    start_ptr,  # (num_experts + 1,) int32: first row of each expert, then the total
    limit_ptr,  # (num_experts,) int32: data rows of each expert
    out_ptr,  # (out_rows, hidden) out
    row_index_ptr,  # (num_tokens * TOPK,) int32 out
    # sizes
    num_tokens,
    hidden,
    num_experts,
    out_rows,
    pairs_per_block,
    # strides
    stride_x,
    stride_out,
    # meta-parameters
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
    ZERO_H: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_tokens:
        # One token: read its row once, write it to its TOPK rows (16-byte vectors when hidden
        # and the row strides are multiples of 8 bf16 elements, which Triton specializes on).
        for k in tl.static_range(TOPK):
            row = _pair_row(
                experts_ptr, rank_ptr, base_ptr, start_ptr, limit_ptr, pid * TOPK + k,
                num_experts, out_rows, pairs_per_block,
            )  # fmt: skip
            tl.store(row_index_ptr + pid * TOPK + k, row)
        cols = tl.arange(0, BLOCK_H)
        src = x_ptr + pid.to(tl.int64) * stride_x + cols
        for h0 in range(0, hidden, BLOCK_H):
            mask = h0 + cols < hidden
            values = tl.load(src + h0, mask=mask)
            for k in tl.static_range(TOPK):
                # Recomputed from cached scalars rather than read back from row_index, which
                # other threads of this program wrote without a barrier.
                row = _pair_row(
                    experts_ptr, rank_ptr, base_ptr, start_ptr, limit_ptr, pid * TOPK + k,
                    num_experts, out_rows, pairs_per_block,
                )  # fmt: skip
                dst = out_ptr + row.to(tl.int64) * stride_out + h0 + cols
                # A dropped pair's row (-1) folds into the column limit: the interpreter
                # mishandles `vector_mask & scalar_condition`.
                tl.store(dst, values, mask=h0 + cols < tl.where(row >= 0, hidden, 0))
    else:
        # ZERO_ROWS output rows: zero those that are padding (past an expert's data, or the tail).
        rows = (pid - num_tokens) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        expert = _expert_of_rows(start_ptr, rows, num_experts, SEARCH_STEPS)
        known = expert < num_experts
        rank = rows - tl.load(start_ptr + expert, mask=known, other=0)
        data = known & (rank < tl.load(limit_ptr + expert, mask=known, other=0))
        _zero_rows(out_ptr, rows, (rows < out_rows) & ~data, hidden, stride_out, ZERO_ROWS, ZERO_H)


@triton.jit
def moe_unpermute_kernel(
    # pointers
    src_ptr,  # (src_rows, hidden)
    row_index_ptr,  # (num_tokens * TOPK,) int32
    weights_ptr,  # (num_tokens * TOPK,) floating, if HAS_WEIGHTS
    out_ptr,  # (num_tokens, hidden) out
    # sizes
    src_rows,
    hidden,
    # strides
    stride_src,
    stride_out,
    # meta-parameters
    TOPK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    for h0 in range(0, hidden, BLOCK_H):
        mask = h0 + cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=COMPUTE_DTYPE)
        for k in tl.static_range(TOPK):  # TOPK independent row loads in flight
            row = tl.load(row_index_ptr + token * TOPK + k)
            used = (row >= 0) & (row < src_rows)
            src = src_ptr + row.to(tl.int64) * stride_src + h0 + cols
            values = tl.load(src, mask=h0 + cols < tl.where(used, hidden, 0), other=0.0)
            values = values.to(COMPUTE_DTYPE)
            if HAS_WEIGHTS:
                weight = tl.load(weights_ptr + token * TOPK + k).to(COMPUTE_DTYPE)
                values = values * tl.where(used, weight, 0.0)
            acc += values
        dst = out_ptr + token.to(tl.int64) * stride_out + h0 + cols
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def moe_mark_rows_kernel(row_index_ptr, used_ptr, n_pairs, src_rows, BLOCK: tl.constexpr):
    """used[row_index[p]] = 1 for every pair: the rows that are not marked are padding."""
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(row_index_ptr + pairs, mask=pairs < n_pairs, other=-1)
    ones = tl.full([BLOCK], 1, dtype=used_ptr.dtype.element_ty)
    tl.store(used_ptr + rows, ones, mask=(rows >= 0) & (rows < src_rows))


@triton.jit
def moe_unpermute_bwd_kernel(
    # pointers
    grad_ptr,  # (num_tokens, hidden): gradient of the unpermute's output
    src_ptr,  # (src_rows, hidden): the unpermute's input, read only for the weights' gradient
    row_index_ptr,  # (num_tokens * TOPK,) int32
    weights_ptr,  # (num_tokens * TOPK,) floating, if HAS_WEIGHTS
    used_ptr,  # (src_rows,) int8: 1 where some pair reads the row
    grad_src_ptr,  # (src_rows, hidden) out
    grad_weights_ptr,  # (num_tokens * TOPK,) out, if WEIGHTS_GRAD
    # sizes
    num_tokens,
    src_rows,
    hidden,
    # strides
    stride_grad,
    stride_src,
    stride_grad_src,
    # meta-parameters
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    WEIGHTS_GRAD: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ZERO_ROWS: tl.constexpr,
    ZERO_H: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_tokens:
        cols = tl.arange(0, BLOCK_H)
        ks = tl.arange(0, TOPK_P2)
        grad_weights = tl.zeros([TOPK_P2], dtype=COMPUTE_DTYPE)
        for h0 in range(0, hidden, BLOCK_H):
            mask = h0 + cols < hidden
            grad = tl.load(grad_ptr + pid.to(tl.int64) * stride_grad + h0 + cols, mask=mask)
            grad = grad.to(COMPUTE_DTYPE)
            for k in tl.static_range(TOPK):
                row = tl.load(row_index_ptr + pid * TOPK + k)
                row_mask = h0 + cols < tl.where((row >= 0) & (row < src_rows), hidden, 0)
                scaled = grad
                if HAS_WEIGHTS:
                    scaled = grad * tl.load(weights_ptr + pid * TOPK + k).to(COMPUTE_DTYPE)
                dst = grad_src_ptr + row.to(tl.int64) * stride_grad_src + h0 + cols
                tl.store(dst, scaled.to(grad_src_ptr.dtype.element_ty), mask=row_mask)
                if WEIGHTS_GRAD:
                    src = src_ptr + row.to(tl.int64) * stride_src + h0 + cols
                    values = tl.load(src, mask=row_mask, other=0.0).to(COMPUTE_DTYPE)
                    dot = tl.sum(grad * values, axis=0)
                    grad_weights += tl.where(ks == k, dot, 0.0)
        if WEIGHTS_GRAD:
            dst = grad_weights_ptr + pid * TOPK + ks
            tl.store(dst, grad_weights.to(grad_weights_ptr.dtype.element_ty), mask=ks < TOPK)
    else:
        rows = (pid - num_tokens) * ZERO_ROWS + tl.arange(0, ZERO_ROWS)
        inside = rows < src_rows
        unused = inside & (tl.load(used_ptr + rows, mask=inside, other=1) == 0)
        _zero_rows(grad_src_ptr, rows, unused, hidden, stride_grad_src, ZERO_ROWS, ZERO_H)
