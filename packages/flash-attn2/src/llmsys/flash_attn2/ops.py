"""Launchers, tile configurations and the ``torch.ops.llmsys.flash_attn2_*`` registrations.

Two ops, registered and launched the way every llmsys kernel package does it
(``llmsys.triton_launch``), so that ``torch.compile(fullgraph=True)`` sees them as opaque calls
and CUDA graphs capture their launches:

    flash_attn2_fwd(q, k, v, causal, scale) -> (out, lse)
    flash_attn2_bwd(grad_out, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)

q is ``(B, N_q, d)`` or ``(B, H, N_q, d)``; k and v ``(B, N_k, d)`` or ``(B, H_kv, N_k, d)``.
The ops themselves are not differentiable: ``flash_attention`` (functional.py) is. The ops
check their arguments (``check_inputs``); the public functions check only what the dispatcher
would reject before them (non-tensors), so each call validates once.
CUDA tensors run the Triton kernels; CPU tensors run them under ``TRITON_INTERPRET=1`` and
otherwise fall back to the plain-PyTorch FlashAttention-2 of ``flash_torch``.

The impls decide the launch on every call; on CUDA, a recorded replay (``llmsys.triton_launch``)
repeats that decision per signature. Code that changes a module switch the impls read
(``FORWARD_KERNEL``, ``DOT_PRECISION``, ``FOLD_SCALE``, ``tile_configs``) calls
``llmsys.triton_launch.forget(flash_attn2_fwd, flash_attn2_bwd)`` after the change and after
undoing it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from llmsys.triton_launch import (
    cdiv,
    checks,
    define_op,
    launch,
    runs_under_interpreter,
    sm_count,
)

from . import kernels
from .flash_torch import check_causal_and_scale, flash_backward_torch, flash_forward_torch
from .tuning import TMA_HEAD_DIMS, TMA_MIN_FLOPS, TMA_TILE, TileConfig, block_d, tile_configs

NAMESPACE = "llmsys"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# fp32 inputs use TF32 tensor-core dots ("fp32 = tf32 dots"); 16-bit inputs ignore this setting.
DOT_PRECISION = "tf32"
# A positive scale is folded into one FMA per score in the forward (kernels._fwd_inner).
FOLD_SCALE = True

# Under TRITON_INTERPRET=1 the kernels run on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(kernels.attn_fwd_kernel)

try:  # host-side tensor descriptors for the copy engine (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the pointer forward everywhere
    TensorDescriptor = None

# Which forward kernel: "auto" takes the TMA kernel where it was measured faster (Hopper or
# later, 16-bit, head dims in tuning.TMA_HEAD_DIMS, contiguous inputs, a wave of tiles), else the
# pointer kernel; the tests force "tma" or "pointer" to cover both (the TMA kernel also runs
# under the interpreter).
FORWARD_KERNEL = "auto"


# --- input checks --------------------------------------------------------------------------------


def check_inputs(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    causal_name: str = "causal",
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit the ops."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(op, name, t, SUPPORTED_DTYPES)
        checks.same_dtype(op, name, t, "q", q)
        checks.same_device(op, name, t, "q", q)
    if q.dim() not in (3, 4):
        raise ValueError(
            f"{op}: `q` must be 3-D (batch, seq, head_dim) or 4-D (batch, heads, seq, head_dim), "
            f"got shape {tuple(q.shape)}"
        )
    if k.dim() != q.dim() or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        layout = "(batch, seq, head_dim)" if q.dim() == 3 else "(batch, kv_heads, seq, head_dim)"
        raise ValueError(
            f"{op}: `k` must be {layout} with the batch and head_dim of `q` {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    if v.shape != k.shape:
        raise ValueError(
            f"{op}: `v` must have the shape of `k` {tuple(k.shape)}, got {tuple(v.shape)}"
        )
    if q.dim() == 4 and (k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0):
        raise ValueError(
            f"{op}: the {k.shape[1]} heads of `k` must divide the {q.shape[1]} heads of `q` "
            "(grouped-query attention)"
        )
    if not 1 <= q.shape[-1] <= MAX_HEAD_DIM:
        raise ValueError(
            f"{op}: `q` head_dim must be between 1 and {MAX_HEAD_DIM}, got {q.shape[-1]}"
        )
    check_causal_and_scale(op, causal, scale, causal_name)


def check_grad_out(op: str, grad_out: torch.Tensor, out: torch.Tensor) -> None:
    checks.tensor(op, "grad_out", grad_out)
    if grad_out.shape != out.shape:
        raise ValueError(
            f"{op}: `grad_out` must have the shape of `out` {tuple(out.shape)}, "
            f"got {tuple(grad_out.shape)}"
        )


# --- launchers -----------------------------------------------------------------------------------


def _alloc(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every output buffer comes from here (tests fill it with NaN to catch unwritten elements),
    on ``like``'s device: ``new_empty`` cost about 1 us less per call than
    ``torch.empty(shape, dtype=, device=)`` on an H100 host (triton-launch DECISIONS.md)."""
    return like.new_empty(shape, dtype=dtype)


def _meta(q: torch.Tensor, config: TileConfig, causal: bool) -> dict:
    """The constexpr arguments of an attention kernel, in its signature's order."""
    d = q.shape[-1]
    return {
        "HEAD_DIM": d,
        "BLOCK_D": block_d(d),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "CAUSAL": causal,
        "DOT_PRECISION": DOT_PRECISION,
        # Triton's interpreter multiplies bfloat16 dot operands as integers: upcast them there.
        "DOT_UPCAST": not q.is_cuda and q.dtype == torch.bfloat16,
        "HEAD_MAJOR": config.head_major,
    }


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def _grid(config: TileConfig, n_heads: int, n_tiles: int) -> tuple[TileConfig, tuple[int, ...]]:
    """The config and its grid: (heads, tiles), or (heads * tiles,) when head-major.

    More than 65535 tiles do not fit a grid's second dimension: those take the head-major order.
    """
    if not config.head_major and n_tiles > MAX_GRID_Y:
        config = dataclasses.replace(config, head_major=True)
    if config.head_major and n_heads * n_tiles >= 2**31:
        raise ValueError(
            f"flash_attention: {n_heads} (batch * heads) x {n_tiles} tiles are more programs "
            "than a CUDA grid holds (2**31 - 1)"
        )
    return config, (n_heads * n_tiles,) if config.head_major else (n_heads, n_tiles)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t.unsqueeze(1)


def _rows_fit_int32(*tensors: torch.Tensor) -> bool:
    # Offsets inside one (batch, head) slice are 32-bit in the kernels.
    return all(
        t.shape[-2] * abs(t.stride(-2)) + t.shape[-1] * abs(t.stride(-1)) < 2**31 for t in tensors
    )


def _fallback_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch FlashAttention-2, one query head of each group at a time (no expansion)."""
    group = q.shape[1] // k.shape[1]
    q_grouped = q.unflatten(1, (k.shape[1], group))  # (B, H_kv, G, N_q, d), a view
    outs, lses = zip(
        *(flash_forward_torch(q_grouped[:, :, g], k, v, causal, scale) for g in range(group)),
        strict=True,
    )
    out = torch.stack(outs, dim=2).flatten(1, 2)  # (B, H, N_q, d)
    lse = torch.stack(lses, dim=2).flatten(1, 2)  # (B, H, N_q)
    return out, lse


def _fallback_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    split = [t.unflatten(1, (k.shape[1], group)) for t in (grad_out, q, out, lse)]
    dqs, dk, dv = (
        [],
        torch.zeros_like(k, dtype=torch.float32),
        torch.zeros_like(v, dtype=torch.float32),
    )
    for g in range(group):
        do_g, q_g, out_g, lse_g = (t[:, :, g] for t in split)
        dq_g, dk_g, dv_g = flash_backward_torch(do_g, q_g, k, v, out_g, lse_g, causal, scale)
        dqs.append(dq_g)
        dk += dk_g
        dv += dv_g
    return torch.stack(dqs, dim=2).flatten(1, 2), dk.to(k.dtype), dv.to(v.dtype)


def flash_attn2_fwd_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)``, ``out`` contiguous in q's shape and dtype, ``lse`` float32."""
    check_inputs("flash_attn2_fwd", q, k, v, causal, scale)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    batch, heads, n_q, d = q4.shape
    out = _alloc(q, (batch, heads, n_q, d), q.dtype)
    lse = _alloc(q, (batch, heads, n_q), torch.float32)
    if out.numel() == 0 or k4.shape[2] == 0:  # no keys: an empty sum, so out = 0 and lse = log(0)
        out.zero_()
        lse.fill_(-math.inf)
    elif not q.is_cuda and not CPU_RUNS_TRITON:
        out_, lse_ = _fallback_forward(q4, k4, v4, causal, scale)
        out.copy_(out_)
        lse.copy_(lse_)
    else:
        if not _rows_fit_int32(q4, k4, v4):  # rare
            q4, k4, v4 = q4.contiguous(), k4.contiguous(), v4.contiguous()
        _launch_forward(q4, k4, v4, out, lse, causal, scale)
    if q.dim() == 3:
        return out.squeeze(1), lse.squeeze(1)
    return out, lse


def _tma_forward_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the TMA forward takes these (checked, 4-D) inputs: see FORWARD_KERNEL."""
    if FORWARD_KERNEL == "pointer" or TensorDescriptor is None:
        return False
    batch, heads, n_q, d = q.shape
    usable = (
        q.dtype in (torch.float16, torch.bfloat16)
        and d == block_d(d)
        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v))
        and batch * heads <= MAX_GRID_Y  # the grid's second dimension
    )
    if FORWARD_KERNEL == "tma":
        return usable
    return (
        usable
        and q.is_cuda
        and d in TMA_HEAD_DIMS
        and torch.cuda.get_device_capability(q.device)[0] >= 9
        # At least a wave of tiles and TMA_MIN_FLOPS of work: below them the kernel takes tens
        # of microseconds and the descriptors' host cost (four of them, through Triton's
        # launcher: about 40 us more per call) is not hidden (DECISIONS.md).
        and batch * heads * cdiv(n_q, TMA_TILE.block_m) >= sm_count(q.device)
        and 2 * batch * heads * n_q * k.shape[2] * d >= TMA_MIN_FLOPS
    )


def _launch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> None:
    """Launch the forward on 4-D views of checked inputs, writing ``out`` and ``lse``."""
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    sizes = (heads, heads // kv_heads, n_q, n_k, float(scale))
    fold = FOLD_SCALE and scale > 0
    if _tma_forward_applies(q, k, v):
        tile = TMA_TILE
        q_view = ([batch * heads, n_q, d], [n_q * d, d, 1], [1, tile.block_m, d])
        kv_view = ([batch * kv_heads, n_k, d], [n_k * d, d, 1], [1, tile.block_n, d])
        descriptors = (
            TensorDescriptor(q, *q_view),
            TensorDescriptor(k, *kv_view),
            TensorDescriptor(v, *kv_view),
            TensorDescriptor(out, *q_view),
        )
        constexprs = {
            "HEAD_DIM": d,
            "BLOCK_M": tile.block_m,
            "BLOCK_N": tile.block_n,
            "CAUSAL": causal,
            "DOT_UPCAST": not q.is_cuda and q.dtype == torch.bfloat16,
            "FOLD_SCALE": fold,
        }
        grid: tuple[int, ...] = (cdiv(n_q, tile.block_m), batch * heads)
        args: tuple = (*descriptors, lse, *sizes)
        launch(kernels.attn_fwd_tma_kernel, grid, args, constexprs, tile.num_warps, tile.num_stages)
        return
    tile = tile_configs(d, q.dtype)[0]
    tile, grid = _grid(tile, batch * heads, cdiv(n_q, tile.block_m))
    strides = (*q.stride(), *k.stride(), *v.stride(), *out.stride())
    constexprs = _meta(q, tile, causal) | {"FOLD_SCALE": fold}
    args = (q, k, v, out, lse, *sizes, *strides)
    launch(kernels.attn_fwd_kernel, grid, args, constexprs, tile.num_warps, tile.num_stages)


def flash_attn2_bwd_impl(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq, dk, dv)``, contiguous, in the shapes and dtype of q, k, v."""
    check_inputs("flash_attn2_bwd", q, k, v, causal, scale)
    check_grad_out("flash_attn2_bwd", grad_out, out)
    if grad_out.dtype != q.dtype:
        grad_out = grad_out.to(q.dtype)
    q4, k4, v4, o4, do4 = (_as_4d(t) for t in (q, k, v, out, grad_out))
    lse3 = lse if lse.dim() == 3 else lse.unsqueeze(1)
    dq = _alloc(q, q4.shape, q.dtype)
    dk = _alloc(k, k4.shape, k.dtype)
    dv = _alloc(v, v4.shape, v.dtype)
    if k4.shape[2] == 0 or q4.numel() == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
    elif not q.is_cuda and not CPU_RUNS_TRITON:
        grads = _fallback_backward(do4, q4, k4, v4, o4, lse3, causal, scale)
        for buffer, grad in zip((dq, dk, dv), grads, strict=True):
            buffer.copy_(grad)
    else:
        if not _rows_fit_int32(q4, k4, v4, o4, do4):  # rare
            q4, k4, v4, o4, do4 = (t.contiguous() for t in (q4, k4, v4, o4, do4))
        _launch_backward(do4, q4, k4, v4, o4, lse3.contiguous(), dq, dk, dv, causal, scale)
    if q.dim() == 3:
        return dq.squeeze(1), dk.squeeze(1), dv.squeeze(1)
    return dq, dk, dv


def _launch_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
) -> None:
    """Launch the backward's two kernels on 4-D views of checked inputs (``lse`` and the
    gradients contiguous). The dQ kernel also writes ``delta = rowsum(dO * O)`` for the dK/dV
    kernel."""
    batch, heads, n_q, d = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    sizes = (heads // kv_heads, n_q, n_k, float(scale))
    _, dkdv_tile, dq_tile = tile_configs(d, q.dtype)
    delta = _alloc(q, (batch, heads, n_q), torch.float32)
    dq_tile, grid = _grid(dq_tile, batch * heads, cdiv(n_q, dq_tile.block_m))
    strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride())
    args = (q, k, v, o, do, lse, delta, dq, heads, *sizes, *strides)
    constexprs = _meta(q, dq_tile, causal)
    warps, stages = dq_tile.num_warps, dq_tile.num_stages
    launch(kernels.attn_bwd_dq_kernel, grid, args, constexprs, warps, stages)
    dkdv_tile, grid = _grid(dkdv_tile, batch * kv_heads, cdiv(n_k, dkdv_tile.block_n))
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride())
    args = (q, k, v, do, lse, delta, dk, dv, kv_heads, *sizes, *strides)
    constexprs = _meta(q, dkdv_tile, causal)
    warps, stages = dkdv_tile.num_warps, dkdv_tile.num_stages
    launch(kernels.attn_bwd_dkdv_kernel, grid, args, constexprs, warps, stages)


# --- registration --------------------------------------------------------------------------------


def _fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    check_inputs("flash_attn2_fwd", q, k, v, causal, scale)
    out = q.new_empty(q.shape)  # contiguous
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)


def _bwd_fake(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    check_inputs("flash_attn2_bwd", q, k, v, causal, scale)
    check_grad_out("flash_attn2_bwd", grad_out, out)
    return tuple(t.new_empty(t.shape) for t in (q, k, v))


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
flash_attn2_fwd = define_op(
    _lib,
    "flash_attn2_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)",
    flash_attn2_fwd_impl,
    _fwd_fake,
    replays=True,  # non-empty inputs; empty ones fill their outputs
)
flash_attn2_bwd = define_op(
    _lib,
    "flash_attn2_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "bool causal, float scale) -> (Tensor, Tensor, Tensor)",
    flash_attn2_bwd_impl,
    _bwd_fake,
    replays=True,  # non-empty inputs, grad_out in q's dtype
)
