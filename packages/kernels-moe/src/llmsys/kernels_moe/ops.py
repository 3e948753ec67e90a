"""Input checks, launchers and the ``torch.ops.llmsys.moe_*`` ops.

Registered and launched the way every llmsys kernel package does it (``llmsys.triton_launch``);
autograd lives in ``functional.py``, the launch configurations in ``tuning.py``. The ops check
their arguments; the public functions check only what the dispatcher would reject first and
their own ``topk``, so a call validates its tensors once. ``moe_permute`` with
``out_rows=None`` needs one host sync (the output's row count is data); that sync also brings
back the validity of the routing, which the kernels compute for free. With ``out_rows`` nothing
waits on the host and nothing data-dependent is checked (see ``padded_moe_permute``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl

from llmsys.triton_launch import (
    cdiv,
    checks,
    define_op,
    launch,
    next_power_of_2,
    runs_under_interpreter,
)

from .kernels import (
    moe_mark_rows_kernel,
    moe_permute_kernel,
    moe_unpermute_bwd_kernel,
    moe_unpermute_kernel,
)
from .reference import moe_unpermute_reference, padded_moe_permute_reference
from .routing_kernels import moe_count_kernel, moe_layout_kernel, moe_route_one_block_kernel
from .tuning import RouteConfig, copy_config, route_config, zero_config

NAMESPACE = "llmsys"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
MAX_ROWS = 2**31 - 1  # row_index is int32

# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(moe_permute_kernel)


# --- checks --------------------------------------------------------------------------------------


def _tensor(op: str, name: str, t: torch.Tensor, dtypes: tuple, kind: str, dim: int) -> None:
    checks.tensor(op, name, t, dtypes, kind)
    if t.dim() != dim:
        raise ValueError(f"{op}: `{name}` must have {dim} dimension(s), got shape {tuple(t.shape)}")


def _same_device(
    op: str, first: tuple[str, torch.Tensor], *others: tuple[str, torch.Tensor | None]
) -> None:
    for name, t in others:
        checks.same_device(op, name, t, *first)


def check_permute_inputs(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    num_experts: int,
    align: int,
    out_rows: int | None,
) -> None:
    """Everything about the permute's arguments that the host knows without a sync."""
    op = "padded_moe_permute"
    _tensor(op, "x", x, FLOAT_DTYPES, "a floating", 2)
    _tensor(op, "top_experts", top_experts, INT_DTYPES, "an integer", 2)
    checks.integer(op, "num_experts", num_experts, 1)
    _tensor(op, "tokens_per_expert", tokens_per_expert, INT_DTYPES, "an integer", 1)
    checks.integer(op, "align", align, 1)
    num_tokens, topk = top_experts.shape
    if num_tokens != x.shape[0]:
        raise ValueError(
            f"{op}: `top_experts` must have one row per token of `x` ({x.shape[0]}), "
            f"got shape {tuple(top_experts.shape)}"
        )
    if tokens_per_expert.shape[0] != num_experts:
        raise ValueError(
            f"{op}: `tokens_per_expert` must have num_experts={num_experts} entries, "
            f"got shape {tuple(tokens_per_expert.shape)}"
        )
    _same_device(
        op, ("x", x), ("top_experts", top_experts), ("tokens_per_expert", tokens_per_expert)
    )
    n_pairs = num_tokens * topk
    if out_rows is not None:
        checks.integer(op, "out_rows", out_rows, 0)
        if out_rows < n_pairs:
            raise ValueError(
                f"{op}: `out_rows` must be at least num_tokens * topk = {n_pairs} (every pair "
                f"needs a row; the safe bound is num_tokens * topk + num_experts * (align - 1) "
                f"= {n_pairs + num_experts * (align - 1)}), got {out_rows}"
            )
        if out_rows > MAX_ROWS:
            raise ValueError(f"{op}: `out_rows` must fit int32 row indices, got {out_rows}")
    if n_pairs > MAX_ROWS:
        raise ValueError(f"{op}: num_tokens * topk must fit int32, got {n_pairs}")


def check_routing_values(
    top_experts: torch.Tensor, tokens_per_expert: torch.Tensor, num_experts: int
) -> None:
    """The data checks: ids in range, counts equal to the ids' histogram (one host sync)."""
    op = "padded_moe_permute"
    flat = top_experts.reshape(-1).long()
    bad = ((flat < 0) | (flat >= num_experts)).nonzero()
    if bad.numel():
        pair = int(bad[0, 0])
        topk = top_experts.shape[1]
        raise ValueError(
            f"{op}: `top_experts` must hold expert ids in [0, num_experts={num_experts}), got "
            f"{int(flat[pair])} at token {pair // topk}, k {pair % topk}"
        )
    actual = torch.bincount(flat, minlength=num_experts)
    wrong = (actual != tokens_per_expert.long()).nonzero()
    if wrong.numel():
        e = int(wrong[0, 0])
        raise ValueError(
            f"{op}: `tokens_per_expert` must count the (token, k) pairs of each expert in "
            f"`top_experts`: tokens_per_expert[{e}] is {int(tokens_per_expert[e])}, but "
            f"{int(actual[e])} pairs chose expert {e}"
        )


def check_unpermute_inputs(
    expert_out: torch.Tensor, row_index: torch.Tensor, routing_weights: torch.Tensor | None
) -> None:
    op = "moe_unpermute"
    _tensor(op, "expert_out", expert_out, FLOAT_DTYPES, "a floating", 2)
    _tensor(op, "row_index", row_index, INT_DTYPES, "an integer", 2)
    if routing_weights is not None:
        _tensor(op, "routing_weights", routing_weights, FLOAT_DTYPES, "a floating", 2)
        if routing_weights.shape != row_index.shape:
            raise ValueError(
                f"{op}: `routing_weights` must have the shape of `row_index` "
                f"({tuple(row_index.shape)}), got {tuple(routing_weights.shape)}"
            )
    _same_device(
        op,
        ("expert_out", expert_out),
        ("row_index", row_index),
        ("routing_weights", routing_weights),
    )


# --- moe_permute ---------------------------------------------------------------------------------


def _route(
    top_experts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    num_experts: int,
    align: int,
    padded: torch.Tensor,
    cfg: RouteConfig,
) -> tuple[torch.Tensor, ...]:
    """Launch the routing passes; returns (row_index, base, rank, start, limit, status) views.

    One int32 allocation holds them all (each torch.empty costs microseconds of host time);
    row_index comes first, so the returned row_index is a contiguous tensor at offset 0.
    """
    n_pairs = top_experts.numel()
    sizes = [n_pairs, cfg.n_blocks * (num_experts + 1), n_pairs, num_experts + 1, num_experts]
    tile = cfg.expert_tile if cfg.n_blocks == 1 else cfg.layout_tile
    sizes.append(2 + cdiv(num_experts, tile))  # total, bad ids, mismatches per expert tile
    work = torch.empty(sum(sizes), dtype=torch.int32, device=top_experts.device)
    row_index, base, rank, start, limit, status = work.split_with_sizes(sizes)
    experts = top_experts.reshape(-1)
    if cfg.n_blocks == 1:
        launch(
            moe_route_one_block_kernel,
            1,
            (experts, tokens_per_expert, rank, base, padded, start, limit, status,
             n_pairs, num_experts, align),
            {"ET": cfg.expert_tile, "CHUNK": cfg.chunk},
        )  # fmt: skip
    else:
        launch(
            moe_count_kernel,
            cfg.n_blocks,
            (experts, rank, base, n_pairs, num_experts, cfg.pairs_per_block),
            {"ET": cfg.expert_tile, "CHUNK": cfg.chunk},
            num_warps=cfg.num_warps,
        )
        launch(
            moe_layout_kernel,
            cdiv(num_experts, cfg.layout_tile),
            (base, tokens_per_expert, padded, start, limit, status,
             cfg.n_blocks, n_pairs, num_experts, align),
            {"ET": cfg.layout_tile, "BLOCKS": max(8192 // cfg.layout_tile, 1)},
        )  # fmt: skip
    return (
        row_index.view(top_experts.shape[0], top_experts.shape[1]),
        base,
        rank,
        start,
        limit,
        status,
    )


def permute(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    num_experts: int,
    align: int = 128,
    out_rows: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The permute after ``check_permute_inputs``."""
    if not x.is_cuda and not CPU_RUNS_TRITON:
        check_routing_values(top_experts, tokens_per_expert, num_experts)
        topk = top_experts.shape[1]
        return padded_moe_permute_reference(
            x, top_experts, tokens_per_expert, topk, num_experts,
            align=align, out_rows=out_rows, return_row_index=True,
        )  # fmt: skip
    num_tokens, hidden = x.shape
    topk = top_experts.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()  # rows may be strided; elements inside a row must not be
    top_experts = top_experts.contiguous()
    tokens_per_expert = tokens_per_expert.contiguous()
    cfg = route_config(num_tokens * topk, num_experts)
    padded = torch.empty_like(tokens_per_expert)
    row_index, base, rank, start, limit, status = _route(
        top_experts, tokens_per_expert, num_experts, align, padded, cfg
    )
    block_h, num_warps = copy_config(hidden, x.element_size())
    zero_rows, zero_h = zero_config(hidden, x.element_size())
    if out_rows is None:
        # The one host sync. A pageable .tolist() measured 11 us of host time per call on the
        # H100 host, a pinned non-blocking copy plus a stream sync 16 us (DECISIONS.md).
        total, n_invalid, *mismatches = status.tolist()
        if n_invalid or any(mismatches):
            check_routing_values(top_experts, tokens_per_expert, num_experts)
        out_rows = total
    out = torch.empty((out_rows, hidden), dtype=x.dtype, device=x.device)
    launch(
        moe_permute_kernel,
        num_tokens + cdiv(out_rows, zero_rows),
        (x, top_experts, rank, base, start, limit, out, row_index,
         num_tokens, hidden, num_experts, out_rows, cfg.pairs_per_block,
         x.stride(0), out.stride(0)),
        {
            "TOPK": topk,
            "BLOCK_H": block_h,
            "ZERO_ROWS": zero_rows,
            "ZERO_H": zero_h,
            "SEARCH_STEPS": num_experts.bit_length(),
        },
        num_warps=num_warps,
    )  # fmt: skip
    return out, padded, row_index


def _moe_permute(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    num_experts: int,
    align: int = 128,
    out_rows: int | None = None,
) -> tuple[torch.Tensor, ...]:
    check_permute_inputs(x, top_experts, tokens_per_expert, num_experts, align, out_rows)
    return permute(x, top_experts, tokens_per_expert, num_experts, align, out_rows)


def _moe_permute_fake(
    x: torch.Tensor,
    top_experts: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    num_experts: int,
    align: int = 128,
    out_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_permute_inputs(x, top_experts, tokens_per_expert, num_experts, align, out_rows)
    rows = torch.library.get_ctx().new_dynamic_size() if out_rows is None else out_rows
    out = x.new_empty((rows, x.shape[1]))
    row_index = x.new_empty(top_experts.shape, dtype=torch.int32)
    return out, torch.empty_like(tokens_per_expert), row_index


# --- moe_unpermute -------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> Any:
    return tl.float64 if dtype == torch.float64 else tl.float32


def unpermute(
    expert_out: torch.Tensor, row_index: torch.Tensor, routing_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The unpermute after ``check_unpermute_inputs``."""
    if not expert_out.is_cuda and not CPU_RUNS_TRITON:
        return moe_unpermute_reference(expert_out, row_index, routing_weights)
    num_tokens, topk = row_index.shape
    src_rows, hidden = expert_out.shape
    if expert_out.stride(1) != 1:
        expert_out = expert_out.contiguous()
    out = torch.empty((num_tokens, hidden), dtype=expert_out.dtype, device=expert_out.device)
    if hidden == 0:
        return out
    has_weights = routing_weights is not None
    weights = routing_weights.contiguous() if routing_weights is not None else row_index
    block_h, num_warps = copy_config(hidden, expert_out.element_size())
    launch(
        moe_unpermute_kernel,
        num_tokens,
        (
            expert_out,
            row_index.contiguous(),
            weights,
            out,
            src_rows,
            hidden,
            expert_out.stride(0),
            out.stride(0),
        ),
        {
            "TOPK": topk,
            "HAS_WEIGHTS": has_weights,
            "COMPUTE_DTYPE": _compute_dtype(expert_out.dtype),
            "BLOCK_H": block_h,
        },
        num_warps=num_warps,
    )
    return out


def _moe_unpermute(
    expert_out: torch.Tensor, row_index: torch.Tensor, routing_weights: torch.Tensor | None = None
) -> torch.Tensor:
    check_unpermute_inputs(expert_out, row_index, routing_weights)
    return unpermute(expert_out, row_index, routing_weights)


def _moe_unpermute_fake(
    expert_out: torch.Tensor, row_index: torch.Tensor, routing_weights: torch.Tensor | None = None
) -> torch.Tensor:
    check_unpermute_inputs(expert_out, row_index, routing_weights)
    return expert_out.new_empty((row_index.shape[0], expert_out.shape[1]))


def _moe_unpermute_backward(
    grad_y: torch.Tensor,
    expert_out: torch.Tensor,
    row_index: torch.Tensor,
    routing_weights: torch.Tensor | None,
    weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of expert_out, grad of routing_weights or an empty tensor)."""
    if not expert_out.is_cuda and not CPU_RUNS_TRITON:
        with torch.enable_grad():
            src = expert_out.detach().requires_grad_()
            weights = routing_weights
            leaves: tuple[torch.Tensor, ...] = (src,)
            if weights_grad:
                assert routing_weights is not None  # (autograd asks only for given weights)
                weights = routing_weights.detach().requires_grad_()
                leaves = (src, weights)
            y = moe_unpermute_reference(src, row_index, weights)
            grads = torch.autograd.grad(y, leaves, grad_y)
        return grads[0], grads[1] if weights_grad else grad_y.new_empty(0)
    num_tokens, topk = row_index.shape
    src_rows, hidden = expert_out.shape
    device = expert_out.device
    grad_y = grad_y if grad_y.stride(-1) == 1 else grad_y.contiguous()
    expert_out = expert_out if expert_out.stride(-1) == 1 else expert_out.contiguous()
    row_index = row_index.contiguous()
    has_weights = routing_weights is not None
    weights = routing_weights.contiguous() if routing_weights is not None else row_index
    grad_src = torch.empty((src_rows, hidden), dtype=expert_out.dtype, device=device)
    if weights_grad:
        assert routing_weights is not None  # (autograd asks only for given weights)
        grad_weights = torch.empty((num_tokens, topk), dtype=routing_weights.dtype, device=device)
    else:
        grad_weights = grad_y.new_empty(0)
    used = torch.zeros(src_rows, dtype=torch.int8, device=device)
    launch(
        moe_mark_rows_kernel,
        cdiv(row_index.numel(), 1024),
        (row_index, used, row_index.numel(), src_rows),
        {"BLOCK": 1024},
    )
    block_h, num_warps = copy_config(hidden, expert_out.element_size())
    zero_rows, zero_h = zero_config(hidden, expert_out.element_size())
    launch(
        moe_unpermute_bwd_kernel,
        num_tokens + cdiv(src_rows, zero_rows),
        (
            grad_y,
            expert_out,
            row_index,
            weights,
            used,
            grad_src,
            grad_weights,
            num_tokens,
            src_rows,
            hidden,
            grad_y.stride(0),
            expert_out.stride(0),
            grad_src.stride(0),
        ),
        {
            "TOPK": topk,
            "TOPK_P2": next_power_of_2(topk),
            "HAS_WEIGHTS": has_weights,
            "WEIGHTS_GRAD": weights_grad,
            "COMPUTE_DTYPE": _compute_dtype(expert_out.dtype),
            "BLOCK_H": block_h,
            "ZERO_ROWS": zero_rows,
            "ZERO_H": zero_h,
        },
        num_warps=num_warps,
    )
    return grad_src, grad_weights


def _moe_unpermute_backward_fake(
    grad_y: torch.Tensor,
    expert_out: torch.Tensor,
    row_index: torch.Tensor,
    routing_weights: torch.Tensor | None,
    weights_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_src = torch.empty_like(expert_out, memory_format=torch.contiguous_format)
    if weights_grad:
        assert routing_weights is not None  # (autograd asks only for given weights)
        return grad_src, torch.empty_like(routing_weights, memory_format=torch.contiguous_format)
    return grad_src, grad_y.new_empty(0)


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
moe_permute = define_op(
    _lib,
    "moe_permute(Tensor x, Tensor top_experts, Tensor tokens_per_expert, int num_experts, "
    "int align=128, SymInt? out_rows=None) -> (Tensor, Tensor, Tensor)",
    _moe_permute,
    _moe_permute_fake,
    replays=True,  # with out_rows given; without, the row count is read back on every call
)
moe_unpermute = define_op(
    _lib,
    "moe_unpermute(Tensor expert_out, Tensor row_index, Tensor? routing_weights) -> Tensor",
    _moe_unpermute,
    _moe_unpermute_fake,
    replays=True,
)
moe_unpermute_backward = define_op(
    _lib,
    "moe_unpermute_backward(Tensor grad_y, Tensor expert_out, Tensor row_index, "
    "Tensor? routing_weights, bool weights_grad) -> (Tensor, Tensor)",
    _moe_unpermute_backward,
    _moe_unpermute_backward_fake,  # not replayed: torch.zeros fills the rows-used marks
)
