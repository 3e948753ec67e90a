"""Triton kernels for FlashAttention-2: one fused forward, a backward of two kernels, no atomics.

Layout: q ``(B, H, N_Q, D)``, k and v ``(B, H_KV, N_K, D)`` with ``H = GROUP * H_KV``; query head
``h`` reads key/value head ``h // GROUP`` in place (grouped-query attention, nothing expanded).
Any strides; batch and head offsets are 64-bit. ``BLOCK_D`` is ``HEAD_DIM`` padded to a power of
two (at least 16): the padded lanes load as zeros and are never stored.

Forward, one program per (batch * head, tile of BLOCK_M queries):

    m = -inf, l = 0, acc = 0                           fp32, on chip
    for each tile of BLOCK_N keys (causal: tiles past the diagonal are skipped):
        s = (q @ k^T) * scale * log2(e)                base-2 logits, so exp2 needs no multiply
        s[masked] = -1e6 * log2(e)                     only on the diagonal tile and the last tile
        m_new = max(m, rowmax(s));  p = exp2(s - m_new);  alpha = exp2(m - m_new)
        l = l * alpha + rowsum(p);  acc = acc * alpha + p @ v;  m = m_new
    O = acc / l;  L = (m + log2(l)) * ln(2)              L is the natural-log log-sum-exp

Backward, with P = exp2(s - L * log2(e)) recomputed tile by tile from L:

    dQ, one program per (batch * head, tile of BLOCK_M queries), looping over key tiles; it first
    computes its rows' D = rowsum(dO * O) and stores them for the next kernel:
        dS = P * (dO v^T - D);  dQ += scale * dS k                          attn_bwd_dq_kernel
    dK/dV, one program per (batch * kv head, tile of BLOCK_N keys); it loops over the GROUP query
    heads of its kv head and their query tiles, accumulating in fp32 registers:
        dV += P^T dO;  dS = P * (dO v^T - D);  dK += scale * dS^T q        attn_bwd_dkdv_kernel

Every output element is written by exactly one program and summed in a fixed order, so two runs
give bitwise-identical gradients. The price is that s and dS are computed twice (7 tile products
per key/query tile pair instead of the 5 of a backward that adds dQ with atomics).

Masking costs only where needed: loads mask rows past N (zeros), scores are masked only on the
causal diagonal tiles and, in the forward and dQ passes, on the last, partial key tile. Rows past
N_Q load zeros and an L of +inf (dK/dV: their P is exactly 0); keys past N_K give garbage only in
rows that are never stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Triton reads module globals only when they are constexpr.
LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2)
MASKED_SCORE_LOG2 = tl.constexpr(-1.0e6 * 1.4426950408889634)  # the reference's -1e6, base 2

# Sequence lengths and the group size change between calls; specializing on them (== 1, multiple
# of 16) would only multiply compiled variants. Strides stay specialized: a unit last stride is
# what makes the loads vectorized.
_SIZES = ["N_HEADS", "GROUP", "N_Q", "N_K"]


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``a @ b (+ acc)`` accumulated in fp32.

    DOT_UPCAST: Triton's interpreter (3.9) multiplies bfloat16 dot operands as raw integers, so on
    CPU they go in as float32 (exact products and an fp32 sum, as the tensor cores do)."""
    if DOT_UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        result = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return result


@triton.jit
def _program_tile(n_rows, BLOCK: tl.constexpr, REVERSED: tl.constexpr, HEAD_MAJOR: tl.constexpr):
    """(batch * head, first row of the tile) of this program; REVERSED: the last tile first.

    The grid is (heads, tiles): one tile of every head is handed out before the next tile; or,
    HEAD_MAJOR, 1-D: all tiles of one head come first, so the programs running at the same time
    share that head's k and v (or q and dO) in L2. Which order is faster depends on the kernel
    and head dim (tile tables in tuning.py). Each order is written in the form that measured fastest
    on an H100: the head-major order as a 2-D (tiles, heads) grid ran the d = 64 dK/dV kernel
    7% slower than this 1-D form, and the (heads, tiles) order as a 1-D grid ran d = 128's 8%
    slower (DECISIONS.md, section 5).
    """
    if HEAD_MAJOR:
        n_tiles = tl.cdiv(n_rows, BLOCK)
        head, tile = tl.program_id(0) // n_tiles, tl.program_id(0) % n_tiles
    else:
        head, tile, n_tiles = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    if REVERSED:
        tile = n_tiles - 1 - tile
    return head, tile * BLOCK


@triton.jit
def _tile_ptrs(base, rows, offs_d, stride_row, stride_d):
    """Pointers to the (len(rows), BLOCK_D) tile of a (seq, dim) matrix at ``base``."""
    return base + rows[:, None] * stride_row + offs_d[None, :] * stride_d


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr):  # fmt: skip
    """Load a (rows, BLOCK_D) tile; rows >= n_rows and lanes >= HEAD_DIM read as 0."""
    if MASK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
            tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _store_rows(ptrs, tile, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


# --- forward -------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k, v, offs_m, offs_n, N_K, qk_scale, MASK: tl.constexpr,
              CAUSAL: tl.constexpr, FOLD_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              DOT_UPCAST: tl.constexpr):  # fmt: skip
    """One key tile of the online softmax; MASK: this tile needs score masks.

    FOLD_SCALE (a positive scale): the row max is taken on the raw scores and scaled once per
    row, and ``s * scale - m`` is a single FMA per score instead of a multiply and a subtract.
    """
    s = _dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST)  # (BLOCK_M, BLOCK_N), raw
    if MASK:
        keep = offs_n[None, :] < N_K
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(keep, s * qk_scale, MASKED_SCORE_LOG2)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    elif FOLD_SCALE:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    else:
        s = s * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
    return acc, l_i, m_new


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_ptrs, v_ptrs, lo, hi, stride_kn, stride_vn, offs_m, offs_d,
               N_K, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               FOLD_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
               DOT_UPCAST: tl.constexpr):  # fmt: skip
    """Online softmax over the key tiles [lo, hi), loaded through pointers."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_rows(k_ptrs + start_n * stride_kn, offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D, MASK)
        v = _load_rows(v_ptrs + start_n * stride_vn, offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D, MASK)
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, q, k, v, offs_m, offs_n, N_K, qk_scale,
            MASK, CAUSAL, FOLD_SCALE, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _key_range(start_m, N_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(full_hi, hi) for the query tile at ``start_m`` (forward and dQ): key tiles [0, full_hi)
    need no mask, [full_hi, hi) do (the causal diagonal and the last, partial tile); keys
    before a tile's first query are visible to all its rows."""
    if CAUSAL:
        hi = tl.minimum(N_K, start_m + BLOCK_M)
        full_hi = tl.minimum(start_m, N_K) // BLOCK_N * BLOCK_N
    else:
        hi = N_K
        full_hi = N_K // BLOCK_N * BLOCK_N
    return full_hi, hi


@triton.jit(do_not_specialize=_SIZES)
def attn_fwd_kernel(
    # pointers
    Q,  # (B, H, N_Q, HEAD_DIM) float16 / bfloat16 / float32, any strides
    K,  # (B, H_KV, N_K, HEAD_DIM) q's dtype, any strides
    V,  # (B, H_KV, N_K, HEAD_DIM) q's dtype, any strides
    Out,  # (B, H, N_Q, HEAD_DIM) q's dtype
    LSE,  # (B, H, N_Q) float32, contiguous
    # sizes
    N_HEADS,  # H
    GROUP,  # H // H_KV
    N_Q,
    N_K,
    sm_scale,
    # strides (batch, head, row, dim)
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two, at least 16
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "tf32" or "ieee": fp32 inputs' dot products
    DOT_UPCAST: tl.constexpr,  # bfloat16 dots in float32 (the interpreter)
    HEAD_MAJOR: tl.constexpr,  # the grid order (_program_tile)
    FOLD_SCALE: tl.constexpr,  # a positive scale, folded into one FMA per score
):
    # Causal tiles at the end of the sequence do the most work: launch them first.
    pid_bh, start_m = _program_tile(N_Q, BLOCK_M, True, HEAD_MAJOR)
    b = (pid_bh // N_HEADS).to(tl.int64)
    h = pid_bh % N_HEADS
    h_kv = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = _tile_ptrs(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qm, stride_qd)
    k_ptrs = _tile_ptrs(K + b * stride_kb + h_kv * stride_kh, offs_n, offs_d, stride_kn, stride_kd)
    v_ptrs = _tile_ptrs(V + b * stride_vb + h_kv * stride_vh, offs_n, offs_d, stride_vn, stride_vd)
    q = _load_rows(q_ptrs, offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    full_hi, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, 0, full_hi, stride_kn, stride_vn, offs_m, offs_d,
        N_K, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, FOLD_SCALE, DOT_PRECISION,
        DOT_UPCAST,
    )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, full_hi, hi, stride_kn, stride_vn, offs_m, offs_d,
        N_K, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, FOLD_SCALE, DOT_PRECISION,
        DOT_UPCAST,
    )  # fmt: skip

    out = acc / l_i[:, None]
    o_ptrs = _tile_ptrs(Out + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_om, stride_od)
    _store_rows(o_ptrs, out.to(Out.dtype.element_ty), offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D)
    lse_ptrs = LSE + (b * N_HEADS + h) * N_Q + offs_m
    tl.store(lse_ptrs, (m_i + tl.log2(l_i)) * LN2, mask=offs_m < N_Q)


@triton.jit(do_not_specialize=_SIZES)
def attn_fwd_tma_kernel(
    # host tensor descriptors over contiguous (B * H, seq, HEAD_DIM) views, and a pointer
    Q,  # (B * H, N_Q, HEAD_DIM) float16 / bfloat16, block (1, BLOCK_M, HEAD_DIM)
    K,  # (B * H_KV, N_K, HEAD_DIM) q's dtype, block (1, BLOCK_N, HEAD_DIM)
    V,  # (B * H_KV, N_K, HEAD_DIM) q's dtype, block (1, BLOCK_N, HEAD_DIM)
    Out,  # (B * H, N_Q, HEAD_DIM) q's dtype, block (1, BLOCK_M, HEAD_DIM)
    LSE,  # (B, H, N_Q) float32, contiguous: a pointer
    # sizes
    N_HEADS,  # H
    GROUP,  # H // H_KV
    N_Q,
    N_K,
    sm_scale,
    # meta-parameters
    HEAD_DIM: tl.constexpr,  # a power of two
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
):
    """The forward with every tile moved by Hopper's copy engine (TMA) instead of pointer
    loads: q, k, v and out are tensor descriptors, tiles past a sequence's end load as zeros
    and are not stored. 16-bit inputs with HEAD_DIM a power of two; grid (query tiles,
    batch * heads)."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the last tiles first
    bh = tl.program_id(1)
    bh_kv = (bh // N_HEADS) * (N_HEADS // GROUP) + (bh % N_HEADS) // GROUP
    q = Q.load([bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    full_hi, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, full_hi, BLOCK_N):
        k = K.load([bh_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = V.load([bh_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, q, k, v, offs_m, start_n + offs_n0, N_K, qk_scale,
            False, CAUSAL, FOLD_SCALE, "tf32", DOT_UPCAST,
        )  # fmt: skip
    for start_n in range(full_hi, hi, BLOCK_N):
        k = K.load([bh_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = V.load([bh_kv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, q, k, v, offs_m, start_n + offs_n0, N_K, qk_scale,
            True, CAUSAL, FOLD_SCALE, "tf32", DOT_UPCAST,
        )  # fmt: skip
    out = acc / l_i[:, None]
    Out.store([bh, start_m, 0], out.to(Out.dtype).reshape(1, BLOCK_M, HEAD_DIM))
    tl.store(LSE + bh * N_Q + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=offs_m < N_Q)


# --- backward ------------------------------------------------------------------------------------


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo, hi, stride_qm,
                stride_dom, offs_n, offs_d, N_Q, qk_scale, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASK_CAUSAL: tl.constexpr,
                MASK_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                DOT_UPCAST: tl.constexpr):  # fmt: skip
    """Accumulate dK, dV of one key tile over the query tiles [lo, hi), in transposed form."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        q_tile = q_ptrs + start_m * stride_qm
        do_tile = do_ptrs + start_m * stride_dom
        q = _load_rows(q_tile, offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D, MASK_ROWS)
        do = _load_rows(do_tile, offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D, MASK_ROWS)
        if MASK_ROWS:  # an L of +inf makes P exactly 0 in rows past N_Q
            lse = tl.load(lse_ptrs + offs_m, mask=offs_m < N_Q, other=float("inf"))
            delta = tl.load(delta_ptrs + offs_m, mask=offs_m < N_Q, other=0.0)
        else:
            lse = tl.load(lse_ptrs + offs_m)
            delta = tl.load(delta_ptrs + offs_m)
        s_t = _dot(k, tl.trans(q), None, DOT_PRECISION, DOT_UPCAST) * qk_scale  # (BLOCK_N, BLOCK_M)
        if MASK_CAUSAL:  # -inf, not -1e6: P is exactly 0 either way, and nothing overflows
            s_t = tl.where(offs_n[:, None] <= offs_m[None, :], s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse[None, :] * LOG2E)
        dv = _dot(p_t.to(do.dtype), do, dv, DOT_PRECISION, DOT_UPCAST)
        dp_t = _dot(v, tl.trans(do), None, DOT_PRECISION, DOT_UPCAST)  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(ds_t.to(q.dtype), q, dk, DOT_PRECISION, DOT_UPCAST)
    return dk, dv


@triton.jit(do_not_specialize=["N_KV_HEADS", "GROUP", "N_Q", "N_K"])
def attn_bwd_dkdv_kernel(
    # pointers
    Q,  # (B, H, N_Q, HEAD_DIM) float16 / bfloat16 / float32, any strides
    K,  # (B, H_KV, N_K, HEAD_DIM) q's dtype, any strides
    V,  # (B, H_KV, N_K, HEAD_DIM) q's dtype, any strides
    DO,  # (B, H, N_Q, HEAD_DIM) q's dtype, any strides: the gradient of the output
    LSE,  # (B, H, N_Q) float32, contiguous
    DELTA,  # (B, H, N_Q) float32, contiguous: rowsum(dO * O), from attn_bwd_dq_kernel
    DK,  # (B, H_KV, N_K, HEAD_DIM) q's dtype
    DV,  # (B, H_KV, N_K, HEAD_DIM) q's dtype
    # sizes
    N_KV_HEADS,  # H_KV
    GROUP,  # H // H_KV
    N_Q,
    N_K,
    sm_scale,
    # strides (batch, head, row, dim)
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_dvd,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two, at least 16
    BLOCK_M: tl.constexpr,  # queries per step
    BLOCK_N: tl.constexpr,  # keys per program
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    # Causal: the first key tiles do the most work, and they come first.
    pid_bh, start_n = _program_tile(N_K, BLOCK_N, False, HEAD_MAJOR)
    b = (pid_bh // N_KV_HEADS).to(tl.int64)
    h_kv = (pid_bh % N_KV_HEADS).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    k_ptrs = _tile_ptrs(K + b * stride_kb + h_kv * stride_kh, offs_n, offs_d, stride_kn, stride_kd)
    v_ptrs = _tile_ptrs(V + b * stride_vb + h_kv * stride_vh, offs_n, offs_d, stride_vn, stride_vd)
    k = _load_rows(k_ptrs, offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D, True)
    v = _load_rows(v_ptrs, offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E

    # Query tiles: [lo, diag_end) cross the diagonal (masked), [diag_end, full_end) are whole and
    # unmasked, [full_end, N_Q) is the last, partial tile. Queries before start_n see no key here.
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        diag_end = tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M), tl.cdiv(N_Q, BLOCK_M)) * BLOCK_M
    else:
        lo = 0
        diag_end = 0
    full_end = tl.maximum(N_Q // BLOCK_M * BLOCK_M, diag_end)
    n_heads = N_KV_HEADS * GROUP
    for g in range(GROUP):  # the query heads that share this kv head, in a fixed order
        h = h_kv * GROUP + g
        q_head = Q + b * stride_qb + h * stride_qh
        do_head = DO + b * stride_dob + h * stride_doh
        q_ptrs = _tile_ptrs(q_head, offs_m0, offs_d, stride_qm, stride_qd)
        do_ptrs = _tile_ptrs(do_head, offs_m0, offs_d, stride_dom, stride_dod)
        lse_ptrs = LSE + (b * n_heads + h) * N_Q
        delta_ptrs = DELTA + (b * n_heads + h) * N_Q
        if CAUSAL:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, lo, diag_end, stride_qm,
                stride_dom, offs_n, offs_d, N_Q, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M,
                True, True, DOT_PRECISION, DOT_UPCAST,
            )  # fmt: skip
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, diag_end, full_end, stride_qm,
            stride_dom, offs_n, offs_d, N_Q, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M,
            False, False, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_ptrs, do_ptrs, lse_ptrs, delta_ptrs, full_end, N_Q, stride_qm,
            stride_dom, offs_n, offs_d, N_Q, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M,
            False, True, DOT_PRECISION, DOT_UPCAST,
        )  # fmt: skip

    dk_head = DK + b * stride_dkb + h_kv * stride_dkh
    dv_head = DV + b * stride_dvb + h_kv * stride_dvh
    dk_ptrs = _tile_ptrs(dk_head, offs_n, offs_d, stride_dkn, stride_dkd)
    dv_ptrs = _tile_ptrs(dv_head, offs_n, offs_d, stride_dvn, stride_dvd)
    dk = (dk * sm_scale).to(DK.dtype.element_ty)
    _store_rows(dk_ptrs, dk, offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D)
    _store_rows(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, lo, hi, stride_kn, stride_vn, offs_m,
              offs_d, N_K, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):  # fmt: skip
    """Accumulate dQ of one query tile over the key tiles [lo, hi); lse is in base 2 here."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = _load_rows(k_ptrs + start_n * stride_kn, offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D, MASK)
        v = _load_rows(v_ptrs + start_n * stride_vn, offs_n, N_K, offs_d, HEAD_DIM, BLOCK_D, MASK)
        s = _dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N)
        if MASK:
            keep = offs_n[None, :] < N_K
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(keep, s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION, DOT_UPCAST)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION, DOT_UPCAST)
    return dq


@triton.jit(do_not_specialize=_SIZES)
def attn_bwd_dq_kernel(
    # pointers
    Q,  # (B, H, N_Q, HEAD_DIM) float16 / bfloat16 / float32, any strides
    K,  # (B, H_KV, N_K, HEAD_DIM) q's dtype, any strides
    V,  # (B, H_KV, N_K, HEAD_DIM) q's dtype, any strides
    Out,  # (B, H, N_Q, HEAD_DIM) q's dtype, any strides: the forward's output
    DO,  # (B, H, N_Q, HEAD_DIM) q's dtype, any strides: its gradient
    LSE,  # (B, H, N_Q) float32, contiguous
    DELTA,  # (B, H, N_Q) float32, contiguous: written here, rowsum(dO * O)
    DQ,  # (B, H, N_Q, HEAD_DIM) q's dtype
    # sizes
    N_HEADS,  # H
    GROUP,  # H // H_KV
    N_Q,
    N_K,
    sm_scale,
    # strides (batch, head, row, dim)
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dqd,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two, at least 16
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per step
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    # The longest query tiles first, as in the forward.
    pid_bh, start_m = _program_tile(N_Q, BLOCK_M, True, HEAD_MAJOR)
    b = (pid_bh // N_HEADS).to(tl.int64)
    h = pid_bh % N_HEADS
    h_kv = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = _tile_ptrs(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qm, stride_qd)
    do_head = DO + b * stride_dob + h * stride_doh
    do_ptrs = _tile_ptrs(do_head, offs_m, offs_d, stride_dom, stride_dod)
    k_ptrs = _tile_ptrs(K + b * stride_kb + h_kv * stride_kh, offs_n, offs_d, stride_kn, stride_kd)
    v_ptrs = _tile_ptrs(V + b * stride_vb + h_kv * stride_vh, offs_n, offs_d, stride_vn, stride_vd)
    o_ptrs = _tile_ptrs(Out + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_om, stride_od)
    q = _load_rows(q_ptrs, offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(do_ptrs, offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D, True)
    o = _load_rows(o_ptrs, offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D, True)
    # D = rowsum(dO * O): these rows' share, stored for the dK/dV kernel that runs next.
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    row = (b * N_HEADS + h) * N_Q + offs_m
    tl.store(DELTA + row, delta, mask=offs_m < N_Q)
    lse = tl.load(LSE + row, mask=offs_m < N_Q, other=0.0) * LOG2E

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    full_hi, hi = _key_range(start_m, N_K, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, 0, full_hi, stride_kn, stride_vn, offs_m, offs_d,
        N_K, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL, DOT_PRECISION, DOT_UPCAST,
    )  # fmt: skip
    dq = _dq_inner(
        dq, q, do, lse, delta, k_ptrs, v_ptrs, full_hi, hi, stride_kn, stride_vn, offs_m, offs_d,
        N_K, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL, DOT_PRECISION, DOT_UPCAST,
    )  # fmt: skip

    dq_head = DQ + b * stride_dqb + h * stride_dqh
    dq_ptrs = _tile_ptrs(dq_head, offs_m, offs_d, stride_dqm, stride_dqd)
    dq = (dq * sm_scale).to(DQ.dtype.element_ty)
    _store_rows(dq_ptrs, dq, offs_m, N_Q, offs_d, HEAD_DIM, BLOCK_D)
