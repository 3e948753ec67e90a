"""Decode attention over a static KV cache: a few new queries per sequence against the cache,
read in place, split across programs and combined in a second pass (issue 46).

Layout: q ``(B, H, Q_LEN, D)`` with ``Q_LEN`` from 1 to 16 (a decode step, or a speculative or
chunked one); ``k_cache`` and ``v_cache`` ``(B, H_KV, CAPACITY, D)``, transformers' static-cache
layout, any strides; ``cache_seqlens`` ``(B,)`` the number of valid cache rows of each sequence,
the ``Q_LEN`` new tokens included (they were appended before the call). Query row ``i`` of
sequence ``b`` sits at position ``p = cache_seqlens[b] - Q_LEN + i`` and sees keys ``0..p``.

Two kernels, no atomics, nothing read back to the host:

    split,   grid (NUM_SPLITS, H_KV * row tiles, B), NUM_SPLITS = ceil(CAPACITY / CHUNK):
        the program of split s reads the keys [s * CHUNK, (s + 1) * CHUNK) of its sequence's
        kv head once, for all GROUP = H / H_KV query heads of that kv head and all Q_LEN rows
        together (GROUP * Q_LEN rows, one dot per key tile), and writes a float32 partial
        (m, l, acc) per row: the base-2 running max, the sum of exp2(s - m) and the unnormalised
        output. Chunks at or past the sequence's length do no work and write m = -inf, l = 0.
    combine, grid (B * H,): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over
        the splits that hold keys (M the largest m_s), in q's dtype.

Partials, float32 and contiguous: ``m`` and ``l`` ``(B, H, Q_LEN, NUM_SPLITS)``, ``acc``
``(B, H, Q_LEN, NUM_SPLITS, D)``; row ``r = g * Q_LEN + i`` of kv head ``h_kv`` is query head
``h_kv * GROUP + g``, so the rows of one program are adjacent in ``(B, H * Q_LEN)``.

An int8 cache (``append_kv_int8`` writes it) comes with float32 scales ``k_scale``, ``v_scale``
``(B, H_KV, CAPACITY)``, one per cached token and head, and is dequantized on load without
dequantizing a tile: a key's scale multiplies its column of scores, and a value's scale its
column of probabilities before the ``p @ v`` dot (int8 values convert exactly to q's dtype):

    s = (q @ k_int8^T) * k_scale * sm_scale,    acc += (p * v_scale) @ v_int8

The grid depends only on the shapes, so a CUDA graph captured once replays for any lengths.
Lengths are clamped to ``[0, CAPACITY]`` on the device (no read past the cache); a row that sees
no key (a length below ``Q_LEN``, which only CPU calls check) comes out NaN.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from llmsys.triton_launch import (
    call_below_autograd,
    cdiv,
    checks,
    define_op,
    launch,
    next_power_of_2,
    sm_count,
    wants_grad,
)

from . import ops
from .kernels import LOG2E, _dot
from .tuning import block_d, decode_chunk, decode_config

OP = "flash_attn2_decode"
MAX_Q_LEN = 16
SEQLEN_DTYPES = (torch.int32, torch.int64)
# At most this many (query head, row) pairs per program; a larger group times Q_LEN is split
# over several row tiles (each reads the chunk's keys again).
MAX_BLOCK_M = 128
# Keys per program; None takes tuning.decode_config's. Tests set a small chunk to get several
# splits from a tiny cache; whoever changes it (or MAX_BLOCK_M) calls
# ``llmsys.triton_launch.forget(flash_attn2_decode)`` after the change and after undoing it.
CHUNK: int | None = None
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third dimensions


# --- kernels -------------------------------------------------------------------------------------


@triton.jit
def _valid_length(SEQLENS, b, stride_lens, CAPACITY):
    """cache_seqlens[b] clamped to [0, CAPACITY]: a bad length never reads past the cache."""
    seqlen = tl.load(SEQLENS + b * stride_lens).to(tl.int32)
    return tl.minimum(tl.maximum(seqlen, 0), CAPACITY)


@triton.jit
def _decode_inner(acc, l_i, m_i, q, k_head, v_head, ks_head, vs_head, lo, hi, seqlen, pos,
                  stride_kn, stride_kd, stride_vn, stride_vd, stride_ksn, stride_vsn, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK: tl.constexpr, INT8_KV: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  DOT_UPCAST: tl.constexpr):  # fmt: skip
    """Online softmax (base 2) over the keys [lo, hi). MASK: keys past a row's position score
    -inf and keys past the length load as zeros (garbage there never reaches a sum); a row
    that has seen no key yet keeps m = -inf, l = 0, acc = 0. INT8_KV: k and v are int8, with
    a float32 scale per key at ks_head / vs_head."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    first = lo.to(tl.int64)  # 64-bit: a long cache times its row stride
    k_ptrs = k_head + first * stride_kn + offs_n0[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_head + first * stride_vn + offs_n0[:, None] * stride_vn + offs_d[None, :] * stride_vd
    ks_ptrs = ks_head + (first + offs_n0) * stride_ksn  # used only when INT8_KV
    vs_ptrs = vs_head + (first + offs_n0) * stride_vsn
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASK:
            in_seq = offs_n[:, None] < seqlen
            k = tl.load(k_ptrs, mask=in_seq & d_ok, other=0.0)
            v = tl.load(v_ptrs, mask=in_seq & d_ok, other=0.0)
        elif BLOCK_D == HEAD_DIM:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
            v = tl.load(v_ptrs, mask=d_ok, other=0.0)
        if INT8_KV:
            if MASK:
                k_scale = tl.load(ks_ptrs, mask=offs_n < seqlen, other=0.0)
                v_scale = tl.load(vs_ptrs, mask=offs_n < seqlen, other=0.0)
            else:
                k_scale = tl.load(ks_ptrs)
                v_scale = tl.load(vs_ptrs)
            # Exact: |k| <= 127 fits every float format's mantissa. (Triton's interpreter
            # converts int8 to bfloat16 bit by bit: there, DOT_UPCAST, go through float32.)
            k = k.to(tl.float32 if DOT_UPCAST else q.dtype)
            v = v.to(tl.float32 if DOT_UPCAST else q.dtype)
        s = _dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N)
        if INT8_KV:
            s = s * k_scale[None, :]
        if MASK:
            s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if INT8_KV:
            p = p * v_scale[None, :]  # after the sum: l counts the probabilities themselves
        acc = _dot(p.to(q.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
        ks_ptrs += BLOCK_N * stride_ksn
        vs_ptrs += BLOCK_N * stride_vsn
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["GROUP", "Q_LEN", "CAPACITY", "NUM_SPLITS"])
def decode_split_kernel(
    # pointers
    Q,  # (B, H, Q_LEN, HEAD_DIM) float16 / bfloat16 / float32, any strides
    K,  # (B, H_KV, CAPACITY, HEAD_DIM) q's dtype, or int8 (INT8_KV), any strides
    V,  # (B, H_KV, CAPACITY, HEAD_DIM) K's dtype, any strides
    K_SCALE,  # (B, H_KV, CAPACITY) float32, any strides: the keys' scales (read when INT8_KV)
    V_SCALE,  # (B, H_KV, CAPACITY) float32, any strides: the values' scales (read when INT8_KV)
    SEQLENS,  # (B,) int32 / int64: valid cache rows per sequence, the new ones included
    M_PART,  # (B, H, Q_LEN, NUM_SPLITS) float32, contiguous: base-2 row max per split
    L_PART,  # (B, H, Q_LEN, NUM_SPLITS) float32, contiguous: sum of exp2(s - m) per split
    ACC_PART,  # (B, H, Q_LEN, NUM_SPLITS, HEAD_DIM) float32, contiguous: unnormalised output
    # sizes
    N_KV_HEADS,  # H_KV
    GROUP,  # H // H_KV
    Q_LEN,
    CAPACITY,
    NUM_SPLITS,
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
    stride_ksb,
    stride_ksh,
    stride_ksn,
    stride_vsb,
    stride_vsh,
    stride_vsn,
    stride_lens,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two, at least 16
    BLOCK_M: tl.constexpr,  # (query head, row) pairs per program, a power of two, at least 16
    BLOCK_N: tl.constexpr,  # keys per step; divides CHUNK
    CHUNK: tl.constexpr,  # keys per program
    INT8_KV: tl.constexpr,  # K and V are int8, dequantized on load with K_SCALE and V_SCALE
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    split = tl.program_id(0)
    n_rows = GROUP * Q_LEN
    n_row_tiles = tl.cdiv(n_rows, BLOCK_M)
    h_kv = (tl.program_id(1) // n_row_tiles).to(tl.int64)
    rows = (tl.program_id(1) % n_row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # g * Q_LEN + i
    b = tl.program_id(2).to(tl.int64)
    i = rows % Q_LEN
    h = h_kv * GROUP + rows // Q_LEN
    row_ok = rows < n_rows
    offs_d = tl.arange(0, BLOCK_D)

    seqlen = _valid_length(SEQLENS, b, stride_lens, CAPACITY)
    pos = seqlen - Q_LEN + i  # each row's position in its sequence: it sees keys 0..pos
    q_ptrs = (
        Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )  # fmt: skip
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    # Keys [start, full_hi) are seen by every row (they precede the first new token's position,
    # seqlen - Q_LEN): no masks. [full_hi, hi) holds the new tokens' diagonal and the last,
    # partial tile. A chunk at or past the length has hi <= start: both loops are empty.
    start = split * CHUNK
    hi = tl.minimum(start + CHUNK, seqlen)
    unmasked = tl.minimum(hi, seqlen - Q_LEN + 1) - start
    full_hi = start + tl.maximum(unmasked, 0) // BLOCK_N * BLOCK_N
    k_head = K + b * stride_kb + h_kv * stride_kh
    v_head = V + b * stride_vb + h_kv * stride_vh
    ks_head = K_SCALE + b * stride_ksb + h_kv * stride_ksh
    vs_head = V_SCALE + b * stride_vsb + h_kv * stride_vsh
    acc, l_i, m_i = _decode_inner(
        acc, l_i, m_i, q, k_head, v_head, ks_head, vs_head, start, full_hi, seqlen, pos,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_ksn, stride_vsn, qk_scale, HEAD_DIM,
        BLOCK_D, BLOCK_N, False, INT8_KV, DOT_PRECISION, DOT_UPCAST,
    )  # fmt: skip
    acc, l_i, m_i = _decode_inner(
        acc, l_i, m_i, q, k_head, v_head, ks_head, vs_head, full_hi, hi, seqlen, pos,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_ksn, stride_vsn, qk_scale, HEAD_DIM,
        BLOCK_D, BLOCK_N, True, INT8_KV, DOT_PRECISION, DOT_UPCAST,
    )  # fmt: skip

    # (b, h, i) flattened is ((b * H_KV + h_kv) * GROUP * Q_LEN + row)
    part = ((b * N_KV_HEADS + h_kv) * n_rows + rows) * NUM_SPLITS + split
    tl.store(M_PART + part, m_i, mask=row_ok)
    tl.store(L_PART + part, l_i, mask=row_ok)
    # An empty chunk's acc is never read (the combine stops at the last chunk with keys).
    acc_rows = rows < tl.where(start < seqlen, n_rows, 0)
    acc_ptrs = ACC_PART + part[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(acc_ptrs, acc, mask=acc_rows[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=["N_HEADS", "Q_LEN", "CAPACITY", "NUM_SPLITS"])
def decode_combine_kernel(
    # pointers
    M_PART,  # (B, H, Q_LEN, NUM_SPLITS) float32, contiguous
    L_PART,  # (B, H, Q_LEN, NUM_SPLITS) float32, contiguous
    ACC_PART,  # (B, H, Q_LEN, NUM_SPLITS, HEAD_DIM) float32, contiguous
    SEQLENS,  # (B,) int32 / int64
    Out,  # (B, H, Q_LEN, HEAD_DIM) q's dtype
    # sizes
    N_HEADS,  # H
    Q_LEN,
    CAPACITY,
    NUM_SPLITS,
    # strides
    stride_lens,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # Q_LEN padded to a power of two
    BLOCK_S: tl.constexpr,  # splits per step
    CHUNK: tl.constexpr,
):
    """One program per (batch, head): its Q_LEN rows' partials, BLOCK_S splits at a time."""
    bh = tl.program_id(0).to(tl.int64)  # b * H + h
    b = bh // N_HEADS
    h = bh % N_HEADS
    seqlen = _valid_length(SEQLENS, b, stride_lens, CAPACITY)
    n_used = tl.cdiv(seqlen, CHUNK)  # the splits that hold keys of this sequence
    offs_q = tl.arange(0, BLOCK_Q)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    q_ok = offs_q < Q_LEN
    d_ok = offs_d < HEAD_DIM

    m_run = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_Q], dtype=tl.float32)
    o = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_used, BLOCK_S):
        splits = s0 + offs_s
        used = q_ok[:, None] & (splits[None, :] < n_used)  # (BLOCK_Q, BLOCK_S)
        part = (bh * Q_LEN + offs_q[:, None]) * NUM_SPLITS + splits[None, :]
        m = tl.load(M_PART + part, mask=used, other=float("-inf"))
        l_s = tl.load(L_PART + part, mask=used, other=0.0)
        acc_ptrs = ACC_PART + part[:, :, None] * HEAD_DIM + offs_d[None, None, :]
        acc = tl.load(acc_ptrs, mask=used[:, :, None] & d_ok[None, None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe[:, None])  # 0 for splits where a row saw no key
        l_run = l_run * alpha + tl.sum(w * l_s, 1)
        o = o * alpha[:, None] + tl.sum(w[:, :, None] * acc, 1)
        m_run = m_new
    out = o / tl.where(q_ok, l_run, 1.0)[:, None]  # (padding rows: no 0 / 0)
    o_ptrs = (
        Out + b * stride_ob + h * stride_oh + offs_q[:, None] * stride_om
        + offs_d[None, :] * stride_od
    )  # fmt: skip
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=q_ok[:, None] & d_ok[None, :])


# --- checks --------------------------------------------------------------------------------------


def check_decode_inputs(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    values: bool = True,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit the op.
    Only metadata is read, except on CPU, where the lengths' values are checked too when
    ``values`` (a fake implementation, under tracing, has none to read)."""
    checks.tensor(op, "q", q, ops.SUPPORTED_DTYPES)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.tensor(op, name, t, (*ops.SUPPORTED_DTYPES, torch.int8))
        checks.same_device(op, name, t, "q", q)
        if k_cache.dtype != torch.int8:
            checks.same_dtype(op, name, t, "q", q)
    checks.same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
    checks.tensor(op, "cache_seqlens", cache_seqlens, SEQLEN_DTYPES)
    checks.same_device(op, "cache_seqlens", cache_seqlens, "q", q)
    if q.dim() != 4:
        raise ValueError(
            f"{op}: `q` must be 4-D (batch, heads, q_len, head_dim), got shape {tuple(q.shape)}"
        )
    batch, heads, q_len, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
        raise ValueError(
            f"{op}: `k_cache` must be (batch, kv_heads, capacity, head_dim) with the batch and "
            f"head_dim of `q` {tuple(q.shape)}, got {tuple(k_cache.shape)}"
        )
    checks.same_shape(op, "v_cache", v_cache, "k_cache", k_cache)
    check_cache_scales(op, k_cache, k_scale, v_scale)
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"{op}: the {kv_heads} heads of `k_cache` must divide the {heads} heads of `q` "
            "(grouped-query attention)"
        )
    if not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"{op}: `q` must have 1 to {MAX_Q_LEN} queries (dim 2), got {q_len}")
    if not 1 <= head_dim <= ops.MAX_HEAD_DIM:
        raise ValueError(
            f"{op}: `q` head_dim must be between 1 and {ops.MAX_HEAD_DIM}, got {head_dim}"
        )
    if capacity < q_len:
        raise ValueError(
            f"{op}: `k_cache` must hold at least the {q_len} new tokens of `q` (capacity, "
            f"dim 2), got {capacity}"
        )
    if cache_seqlens.shape != (batch,):
        raise ValueError(
            f"{op}: `cache_seqlens` must have shape ({batch},) (one length per sequence), got "
            f"{tuple(cache_seqlens.shape)}"
        )
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"{op}: `sm_scale` must be a float or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"{op}: `sm_scale` must be finite, got {sm_scale}")
    if values and cache_seqlens.device.type == "cpu" and batch:  # a GPU's stay on the GPU
        low, high = int(cache_seqlens.min()), int(cache_seqlens.max())
        if low < q_len or high > capacity:
            raise ValueError(
                f"{op}: `cache_seqlens` must be between the {q_len} new tokens and the capacity "
                f"{capacity}, got values from {low} to {high}"
            )


def check_cache_scales(
    op: str, k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> None:
    """An int8 cache has both scales, float32 ``(B, H_KV, CAPACITY)`` on its device; a float
    cache has none. ``k_cache`` is already checked."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if k_cache.dtype != torch.int8:
            if scale is not None:
                raise ValueError(
                    f"{op}: `{name}` goes with an int8 cache, but `k_cache` has dtype "
                    f"{k_cache.dtype}: pass no scales with a float cache"
                )
            continue
        if scale is None:
            raise ValueError(
                f"{op}: an int8 `k_cache` needs `{name}` (float32, one scale per cached token "
                "and head), got None"
            )
        checks.tensor(op, name, scale, (torch.float32,))
        checks.same_device(op, name, scale, "k_cache", k_cache)
        if scale.shape != k_cache.shape[:3]:
            raise ValueError(
                f"{op}: `{name}` must have shape {tuple(k_cache.shape[:3])} (batch, kv_heads, "
                f"capacity: one scale per cached token and head), got {tuple(scale.shape)}"
            )


# --- launcher ------------------------------------------------------------------------------------


def _decode_fallback(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Plain PyTorch, float32, any device: the masked softmax over the whole (dequantized)
    cache, the query heads grouped per kv head through a view (not copied to H heads)."""
    _, heads, q_len, _ = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    q5 = q.float().unflatten(1, (kv_heads, heads // kv_heads))  # (B, H_KV, G, Q, D)
    keys = torch.arange(capacity, device=q.device)
    lengths = cache_seqlens.clamp(0, capacity).to(keys.dtype)
    in_seq = keys < lengths[:, None]  # (B, CAP)
    k, v = k_cache.float(), v_cache.float()
    if k_scale is not None and v_scale is not None:  # (both or neither: checked)
        k, v = k * k_scale[..., None], v * v_scale[..., None]
    k = torch.where(in_seq[:, None, :, None], k, 0.0)  # garbage past the length
    v = torch.where(in_seq[:, None, :, None], v, 0.0)
    pos = lengths[:, None] - q_len + torch.arange(q_len, device=q.device)  # (B, Q)
    seen = keys <= pos[:, :, None]  # (B, Q, CAP)
    scores = q5 @ k.unsqueeze(2).transpose(-2, -1) * sm_scale  # (B, H_KV, G, Q, CAP)
    scores = torch.where(seen[:, None, None], scores, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v.unsqueeze(2)
    return out.flatten(1, 2)


def flash_attn2_decode_impl(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out`` ``(B, H, Q_LEN, D)``, contiguous, q's dtype: see the module docstring."""
    check_decode_inputs(OP, q, k_cache, v_cache, cache_seqlens, sm_scale, k_scale, v_scale)
    batch, heads, q_len, d = q.shape
    kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    out = ops._alloc(q, (batch, heads, q_len, d), q.dtype)
    if batch == 0:
        return out
    if not q.is_cuda and not ops.CPU_RUNS_TRITON:
        fallback = _decode_fallback(q, k_cache, v_cache, cache_seqlens, sm_scale, k_scale, v_scale)
        out.copy_(fallback)
        return out
    config = decode_config(d, q.dtype)
    group = heads // kv_heads
    block_m = min(max(16, next_power_of_2(group * q_len)), MAX_BLOCK_M)
    row_programs = kv_heads * cdiv(group * q_len, block_m)
    if row_programs > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(
            f"{OP}: {batch} sequences and {row_programs} (kv head, row tile) programs do not fit "
            f"a CUDA grid (at most {MAX_GRID_YZ} each)"
        )
    sms = sm_count(q.device) if q.is_cuda else 1
    chunk = CHUNK or decode_chunk(config, capacity, row_programs * batch, sms)
    block_n = min(config.block_n, chunk)
    num_splits = cdiv(capacity, chunk)
    m_part = ops._alloc(q, (batch, heads, q_len, num_splits), torch.float32)
    l_part = ops._alloc(q, (batch, heads, q_len, num_splits), torch.float32)
    acc_part = ops._alloc(q, (batch, heads, q_len, num_splits, d), torch.float32)
    int8_kv = k_scale is not None
    scale_strides: tuple[int, ...]
    if k_scale is None or v_scale is None:  # (both or neither: checked)
        # the kernel reads no scale: any pointer will do, and zero strides
        k_scale, v_scale, scale_strides = k_cache, v_cache, (0,) * 6
    else:
        scale_strides = (*k_scale.stride(), *v_scale.stride())
    sizes = (kv_heads, group, q_len, capacity, num_splits, float(sm_scale))
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides)
    args: tuple = (q, k_cache, v_cache, k_scale, v_scale, cache_seqlens, m_part, l_part, acc_part)
    args = (*args, *sizes, *strides, cache_seqlens.stride(0))
    constexprs = {
        "HEAD_DIM": d,
        "BLOCK_D": block_d(d),
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "CHUNK": chunk,
        "INT8_KV": int8_kv,
        "DOT_PRECISION": ops.DOT_PRECISION,
        # Triton's interpreter multiplies bfloat16 dot operands as integers: upcast them there.
        "DOT_UPCAST": not q.is_cuda and q.dtype == torch.bfloat16,
    }
    grid = (num_splits, row_programs, batch)
    launch(decode_split_kernel, grid, args, constexprs, config.num_warps, config.num_stages)
    args = (m_part, l_part, acc_part, cache_seqlens, out, heads, q_len, capacity, num_splits)
    args = (*args, cache_seqlens.stride(0), *out.stride())
    constexprs = {
        "HEAD_DIM": d,
        "BLOCK_D": block_d(d),
        "BLOCK_Q": next_power_of_2(q_len),
        "BLOCK_S": min(16, next_power_of_2(num_splits)),
        "CHUNK": chunk,
    }
    launch(decode_combine_kernel, (batch * heads,), args, constexprs, 4)
    return out


# --- registration --------------------------------------------------------------------------------


def _decode_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    sm_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    check_decode_inputs(
        OP, q, k_cache, v_cache, cache_seqlens, sm_scale, k_scale, v_scale, values=False
    )
    return q.new_empty(q.shape)  # contiguous


def inference_only_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} is inference-only: it has no backward. Run it under torch.no_grad() or "
        "torch.inference_mode(), or pass detached tensors."
    )


_lib = torch.library.Library(ops.NAMESPACE, "FRAGMENT")
flash_attn2_decode = define_op(
    _lib,
    "flash_attn2_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, "
    "float sm_scale, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
    flash_attn2_decode_impl,
    _decode_fake,
    replays=True,  # a non-empty batch
)


def _refuse_grad(ctx: Any, inputs: tuple, output: object) -> None:
    raise inference_only_error("torch.ops.llmsys.flash_attn2_decode")


torch.library.register_autograd(
    flash_attn2_decode, lambda ctx, grad: None, setup_context=_refuse_grad
)


# --- public --------------------------------------------------------------------------------------


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few new tokens per sequence over a static KV cache, read in place.

    Args:
        q: the new tokens' queries, ``(B, H, Q_LEN, D)``, ``Q_LEN`` from 1 to 16; float16,
            bfloat16 or float32 (TF32 dots on a GPU); any strides.
        k_cache: ``(B, H_KV, CAPACITY, D)`` (transformers' ``StaticCache`` layout, one layer),
            q's dtype, or int8 with ``k_scale`` and ``v_scale`` (written by ``append_kv_int8``);
            on q's device, any strides (a slice of a larger buffer is read in place).
            ``H_KV`` divides ``H``: query head ``h`` reads kv head ``h // (H // H_KV)``.
        v_cache: the shape, dtype and device of ``k_cache``.
        cache_seqlens: ``(B,)`` int32 or int64 on q's device: each sequence's valid cache rows,
            the ``Q_LEN`` new tokens included (appended before the call), from ``Q_LEN`` to
            ``CAPACITY``. Checked on CPU only (a CUDA check would wait for the GPU); on CUDA
            a length outside that range is clamped to ``[0, CAPACITY]`` and rows that then see
            no key are NaN. Cache rows past a sequence's length are never used.
        sm_scale: the score scale, default ``1 / sqrt(D)``.
        k_scale: for an int8 cache (required with one, refused with a float one), the keys'
            scales ``(B, H_KV, CAPACITY)`` float32 on q's device, any strides: cached key ``n``
            of head ``h`` is ``k_cache[b, h, n] * k_scale[b, h, n]``, dequantized on load.
        v_scale: the values' scales, as ``k_scale``.

    Returns:
        ``(B, H, Q_LEN, D)``, contiguous, q's dtype: row ``i`` of sequence ``b`` attends to
        keys ``0 .. cache_seqlens[b] - Q_LEN + i`` (causal within the new tokens, aligned to
        the end of each sequence). No host synchronisation; the launch grid depends only on the
        shapes, so a CUDA graph captured once replays for any lengths. Inference only.

    Raises:
        TypeError: an argument is not a tensor, or a dtype is unsupported or mismatched.
        ValueError: shapes, head counts, ``Q_LEN``, devices or (CPU) lengths do not fit; an
            int8 cache without both scales, or scales with a float cache.
        RuntimeError: grad mode is on and an input requires grad.
    """
    checks.tensors(
        "decode_attention", ("k_scale", "v_scale"), q=q, k_cache=k_cache, v_cache=v_cache,
        cache_seqlens=cache_seqlens, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if wants_grad(q, k_cache, v_cache, k_scale, v_scale):
        raise inference_only_error("decode_attention")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() and q.shape[-1] else 1.0
    elif isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(
            f"decode_attention: `sm_scale` must be a float or None, got {type(sm_scale).__name__}"
        )
    try:
        return call_below_autograd(
            flash_attn2_decode,
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            float(sm_scale),
            k_scale,
            v_scale,
        )
    except (TypeError, ValueError) as error:  # named as the caller called it
        raise checks.as_called(error, "decode_attention") from None
