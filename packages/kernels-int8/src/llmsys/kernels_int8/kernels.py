"""Triton kernels: per-row INT8 quantization and the W8A8 GEMM with its split-K epilogue.

    quantize_int8_perrow_kernel     x (M, K) float -> q (M, K) int8, scale (M,): one read, one write
    perrow_w8a8_matmul_kernel       int8 x int8 tensor-core dot, int32 accumulator, fp32
                                    epilogue; any strides, any K, split-K (decode, odd shapes)
    perrow_w8a8_matmul_tma_kernel   the same product, persistent and fed by TMA (prefill)
    splitk_epilogue_kernel          sums a split-K launch's int32 partials, then the epilogue

Offsets along M and N are 64-bit, so tensors past 2**31 elements index correctly. M is not
specialized on (`do_not_specialize`): one binary per configuration serves every batch size.
N and K are, on purpose: the compiler vectorizes a masked load or store only when it can prove
the mask constant over the vector, i.e. when it knows K (or N) is a multiple of 16; without
that the quantizer and the pointer-based GEMM ran 2-4x slower on an H100 (DECISIONS.md). Every
measured number quoted here is in DECISIONS.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmsys.triton_launch.precise import round_half_even

# --- quantization --------------------------------------------------------------------------------


@triton.jit
def _abs_nan_as_inf(x):
    # |x| with NaN read as +inf: tl.max ignores NaN, and a NaN row must not get a finite scale.
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def _store_scale(scale_ptr, rows, row_mask, amax):
    # scale = amax / 127 with IEEE division, rounded to the scale's dtype; the returned float32
    # copy of the *stored* scale is what q divides by, so q * scale is what a consumer rebuilds.
    # A row holding a NaN or Inf (amax = inf) gets a NaN scale, so everything computed from it
    # downstream is NaN, as the float path would give, with no host synchronisation.
    scale = tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    scale = tl.where(amax < float("inf"), scale, float("nan"))
    scale = scale.to(scale_ptr.dtype.element_ty)
    tl.store(scale_ptr + rows, scale, mask=row_mask)
    return scale.to(tl.float32)


@triton.jit
def _quantize(x, scale, PRECISE: tl.constexpr):
    # x (BLOCK_M, BLOCK_K) float32, scale (BLOCK_M,) float32 -> (BLOCK_M, BLOCK_K) int8.
    # A row whose scale is 0 (all zeros, or a float16 scale that underflowed) gives zeros, not NaN;
    # so does a row whose scale is NaN (it held a NaN or Inf).
    nonzero = scale > 0
    divisor = tl.broadcast_to(tl.where(nonzero, scale, 1.0)[:, None], x.shape)
    y = tl.div_rn(x, divisor)  # IEEE division, as eager `x / scale`
    y = round_half_even(tl.minimum(tl.maximum(y, -127.0), 127.0), PRECISE)  # torch.round's rule
    return tl.where(nonzero[:, None], y, 0.0).to(tl.int8)


@triton.jit(do_not_specialize=["M"])
def quantize_int8_perrow_kernel(
    # pointers
    x_ptr,  # (M, K) float16 / bfloat16 / float32, any strides
    q_ptr,  # (M, K) int8, unit column stride
    scale_ptr,  # (M,) x's dtype
    # sizes
    M,
    K,
    # strides
    stride_xm,
    stride_xk,
    stride_qm,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,  # columns per step (>= K when ONE_PASS)
    ONE_PASS: tl.constexpr,  # the row fits in one block: x is read once
    PRECISE: tl.constexpr,  # libdevice's rint; False under the interpreter
):
    """Symmetric per-row quantization, BLOCK_M rows per program.

        amax  = max_k |x[m, k]|                      (masked lanes load 0, so they never win;
                                                      NaN counts as inf)
        scale = round_to_dtype(amax / 127)           stored; NaN where amax is inf
        q     = rint(clamp(x / scale, -127, 127))    0 where scale is 0 or NaN

    ONE_PASS keeps the rows in registers between the max and the divide: 3 bytes moved per float16
    element, the floor. Rows longer than one block take two passes, the first asking L2 to keep
    the row (evict_last) so that the second reads it from there.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    x_rows = x_ptr + rows[:, None] * stride_xm  # (BLOCK_M, 1)
    q_rows = q_ptr + rows[:, None] * stride_qm  # (BLOCK_M, 1)
    if ONE_PASS:
        mask = row_mask[:, None] & (cols[None, :] < K)  # (BLOCK_M, BLOCK_K)
        x_ptrs = x_rows + cols[None, :].to(tl.int64) * stride_xk
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        scale = _store_scale(scale_ptr, rows, row_mask, tl.max(_abs_nan_as_inf(x), axis=1))
        tl.store(q_rows + cols[None, :], _quantize(x, scale, PRECISE), mask=mask)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k + cols[None, :] < K)
            x_ptrs = x_rows + (k + cols[None, :]).to(tl.int64) * stride_xk
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
            amax = tl.maximum(amax, tl.max(_abs_nan_as_inf(x.to(tl.float32)), axis=1))
        scale = _store_scale(scale_ptr, rows, row_mask, amax)
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k + cols[None, :] < K)
            x_ptrs = x_rows + (k + cols[None, :]).to(tl.int64) * stride_xk
            x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            q = _quantize(x.to(tl.float32), scale, PRECISE)
            tl.store(q_rows + k + cols[None, :], q, mask=mask)


# --- GEMM ----------------------------------------------------------------------------------------


@triton.jit
def _scale_epilogue(
    acc, a_scale_ptr, b_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS: tl.constexpr
):
    # acc (BLOCK_M, BLOCK_N) int32 or int64 -> float32. Everything after the integer sum is
    # float32 and the cast to the output dtype comes last: a float16 `acc * a_scale` can reach
    # inf (|acc| up to K * 127**2) before `b_scale` brings it back.
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        out = out + bias[None, :]
    return out


@triton.jit
def _tile_coordinates(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Tiles in groups of GROUP_M row-blocks, column by column inside a group, so the programs
    # running at once share A rows and B columns in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile_id // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % num_pid_in_group) % group_size_m
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def perrow_w8a8_matmul_kernel(
    # pointers
    a_ptr,  # (M, K) int8; row-major is the fast layout
    b_ptr,  # (K, N) int8; column-major (stride_bk == 1) is the fast layout
    c_ptr,  # (M, N) output, or (splits, M, N) int32 partials when PARTIALS
    a_scale_ptr,  # (M,) float
    b_scale_ptr,  # (N,) float
    bias_ptr,  # (N,) float, or any pointer when not HAS_BIAS
    # sizes
    M,
    N,
    K,
    K_PER_SPLIT,  # K range of one split: a multiple of BLOCK_K, at most 131071 (int32-exact)
    # strides
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cs,  # between split planes of the partials (0 without PARTIALS)
    stride_cm,
    stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # row-blocks per group of the L2-friendly launch order
    PARTIALS: tl.constexpr,  # split-K (grid axis 1 > 1): write int32 partials, no epilogue
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the main loop
    HAS_BIAS: tl.constexpr,
):
    """C = (A @ B) * a_scale[:, None] * b_scale[None, :] (+ bias), one (BLOCK_M, BLOCK_N) tile each.

        for k in this split's K range, BLOCK_K at a time:
            acc += dot(A[m, k], B[k, n])            int8 x int8 -> int32 on the tensor cores
        C[m, n] = cast(float(acc) * a_scale[m] * b_scale[n] (+ bias[n]))     one split
        P[split, m, n] = acc                                                  PARTIALS

    The int32 sum is exact while a split covers at most (2**31 - 1) // 128**2 = 131071 of K (the
    launcher splits longer K). Tiles are visited in groups of GROUP_M row-blocks so a group's A
    rows and B columns stay in L2. Rows past M and columns past N wrap to valid ones, so the
    loads need no mask along M and N; only the store is masked.
    """
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coordinates(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    k_start = pid_k * K_PER_SPLIT
    a_ptrs = (
        a_ptr
        + (offs_m % M).to(tl.int64)[:, None] * stride_am
        + (k_start + offs_k).to(tl.int64)[None, :] * stride_ak
    )  # (BLOCK_M, BLOCK_K)
    b_ptrs = (
        b_ptr
        + (k_start + offs_k).to(tl.int64)[:, None] * stride_bk
        + (offs_n % N).to(tl.int64)[None, :] * stride_bn
    )  # (BLOCK_K, BLOCK_N)

    k_len = tl.minimum(K - k_start, K_PER_SPLIT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_len - k, other=0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_len - k, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # (BLOCK_M, BLOCK_N)
    c_ptrs = (
        c_ptr
        + pid_k.to(tl.int64) * stride_cs
        + offs_m.to(tl.int64)[:, None] * stride_cm
        + offs_n[None, :] * stride_cn
    )  # (BLOCK_M, BLOCK_N)
    if PARTIALS:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        out = _scale_epilogue(
            acc, a_scale_ptr, b_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS
        )
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "num_programs"])
def perrow_w8a8_matmul_tma_kernel(
    # tensor descriptors (Hopper's bulk tensor copy engine)
    a_desc,  # over a (M, K) int8 row-major, block (BLOCK_M, BLOCK_K)
    b_desc,  # over b.T (N, K) int8 row-major (b column-major), block (BLOCK_N, BLOCK_K)
    c_desc,  # over c (M, N), block (BLOCK_M, BLOCK_N // 2); used only when TMA_STORE
    # pointers
    c_ptr,  # (M, N) output
    a_scale_ptr,  # (M,)
    b_scale_ptr,  # (N,)
    bias_ptr,  # (N,) or any pointer when not HAS_BIAS
    # sizes
    M,
    N,
    K,
    num_programs,  # the grid: at most one program per SM
    # strides
    stride_cm,
    stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    TMA_STORE: tl.constexpr,  # store through c_desc in two halves, else masked pointer stores
    SWAP_AB: tl.constexpr = False,  # compute C.T = B.T @ A.T (decode: M too small for wgmma)
):
    """The prefill GEMM, and the decode one with ``SWAP_AB``: the same product and epilogue,
    persistent and fed by TMA.

        for tile in program_id, program_id + num_programs, ... (one loop, flattened):
            for k: acc += dot(TMA-load A[m, k], TMA-load B.T[n, k].T)   int32
                   (SWAP_AB: acc.T += dot(B.T[n, k], A[m, k].T))
            C[m, n] = cast(float(acc) * a_scale[m] * b_scale[n] (+ bias[n]))

    The copy engine loads whole tiles into shared memory (zero-filling past M, N and K), which
    frees the warps from address arithmetic; a grid of one program per SM that walks the tiles
    in a loop the compiler flattens lets the next tile's loads start during this tile's
    epilogue. Both were measured on an H100 (DECISIONS.md). K must be a multiple of 16 (the
    descriptor's row stride), and one tile's K sum must stay int32-exact (K <= 131071).

    At decode (M <= 16) the wide side is N: with ``SWAP_AB`` the weight tile is the MMA's left
    operand (BLOCK_N rows, as Hopper's warp-group MMA wants 64) and the few activation rows its
    right one, so the weights stream through the copy engine into the warp-group MMA.
    """
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=True):
        pid_m, pid_n = _tile_coordinates(tile_id, num_pid_m, num_pid_n, GROUP_M)
        if SWAP_AB:
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
            for k in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k])  # (BLOCK_M, BLOCK_K)
                b = b_desc.load([pid_n * BLOCK_N, k])  # (BLOCK_N, BLOCK_K)
                acc_t = tl.dot(b, a.T, acc_t, out_dtype=tl.int32)
            acc = acc_t.T  # (BLOCK_M, BLOCK_N)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for k in range(0, K, BLOCK_K):
                a = a_desc.load([pid_m * BLOCK_M, k])  # (BLOCK_M, BLOCK_K)
                b = b_desc.load([pid_n * BLOCK_N, k])  # (BLOCK_N, BLOCK_K)
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        if TMA_STORE:
            # Two (BLOCK_M, BLOCK_N / 2) halves: half the shared memory for staging the store.
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc_left, acc_right = tl.split(halves)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)  # (BLOCK_N // 2,)
            out = _scale_epilogue(
                acc_left, a_scale_ptr, b_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS
            )
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out.to(c_desc.dtype))
            offs_n += BLOCK_N // 2
            out = _scale_epilogue(
                acc_right, a_scale_ptr, b_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS
            )
            c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], out.to(c_desc.dtype))
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
            out = _scale_epilogue(
                acc, a_scale_ptr, b_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS
            )
            mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "splits"])
def splitk_epilogue_kernel(
    # pointers
    partial_ptr,  # (splits, M, N) int32, contiguous
    c_ptr,  # (M, N) output
    a_scale_ptr,  # (M,)
    b_scale_ptr,  # (N,)
    bias_ptr,  # (N,) or any pointer when not HAS_BIAS
    # sizes
    M,
    N,
    splits,
    # strides
    stride_ps,  # between split planes of the partials: M * N
    stride_cm,
    stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """C[m, n] = cast(float(sum_split P[split, m, n]) * a_scale[m] * b_scale[n] (+ bias[n])).

    The partials are summed in int64, so K may exceed the int32-exact 131071 once it is split.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)  # (BLOCK_M, BLOCK_N)
    p_ptrs = partial_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int64)
    for _ in range(splits):
        acc += tl.load(p_ptrs, mask=mask, other=0).to(tl.int64)
        p_ptrs += stride_ps
    out = _scale_epilogue(acc, a_scale_ptr, b_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)
