"""Triton kernels for the padded MoE permute and its inverse: the row copies.

The routing (routing_kernels.py) gives every (token, k) pair its padded row. Each copy program
owns one token and reads its row of ``x`` once:

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
