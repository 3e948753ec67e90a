"""Input checks, launchers and the ``torch.ops.llmsys.int8_*`` registrations.

    int8_quantize_perrow(Tensor x) -> (Tensor q, Tensor scale)
    int8_matmul(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor? bias) -> Tensor
    int8_matmul_out(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor? bias,
                    Tensor(a!) out) -> ()
    int8_matmul_quantize(Tensor x, Tensor b, Tensor b_scale, Tensor? bias) -> Tensor
                         (the two above in one call)

Registered and launched the way every llmsys kernel package does it (``llmsys.triton_launch``),
so ``torch.compile(fullgraph=True)`` sees them as single nodes and CUDA graphs capture them. They
are inference-only: the GEMM's Autograd-key kernel (functional.py) raises when grad mode is on
and a scale or the bias requires grad; the quantizer's outputs never require grad (``q`` is
integer, the scale is treated as a constant), so callers that quantize differentiable
activations (functional.py, modules.py) raise themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

import torch

from llmsys.triton_launch import cdiv, checks, define_op, launch, runs_under_interpreter, sm_count

from . import tuning
from .kernels import (
    perrow_w8a8_matmul_kernel,
    perrow_w8a8_matmul_tma_kernel,
    quantize_int8_perrow_kernel,
    splitk_epilogue_kernel,
)
from .reference import matmul_int8_reference, quantize_int8_perrow_reference

try:  # host-side tensor descriptors for the copy engine (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the pointer kernel does everything
    TensorDescriptor = None

NAMESPACE = "llmsys"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The int32 accumulator is exact for at most this many int8 products (|a * b| <= 128 * 128);
# a longer K is split into ranges of at most this length whose partials are summed in int64.
MAX_K_PER_SPLIT = (2**31 - 1) // (128 * 128)  # 131071

# Under TRITON_INTERPRET=1 `triton.jit` returns an interpreter object that runs on CPU tensors.
CPU_RUNS_TRITON = runs_under_interpreter(quantize_int8_perrow_kernel)


# --- checks --------------------------------------------------------------------------------------


def _check_tensor(
    op: str, name: str, t: torch.Tensor, dtypes: Collection[torch.dtype], dim: int, shape_doc: str
) -> None:
    checks.tensor(op, name, t, dtypes)
    if t.dim() != dim:
        raise ValueError(f"{op}: `{name}` must be {dim}-D {shape_doc}, got shape {tuple(t.shape)}")


def check_quantize_input(x: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``x`` unless it is a 2-D float tensor."""
    _check_tensor("int8_quantize_perrow", "x", x, FLOAT_DTYPES, 2, "(M, K); reshape(-1, K) first")


def check_matmul_inputs(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad argument of the GEMM."""
    op = "int8_matmul"
    _check_tensor(op, "a", a, (torch.int8,), 2, "(M, K)")
    _check_tensor(op, "b", b, (torch.int8,), 2, "(K, N)")
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k:
        raise ValueError(
            f"{op}: `b` must have K = a.shape[1] = {k} rows, got shape {tuple(b.shape)}"
        )
    _check_tensor(op, "a_scale", a_scale, FLOAT_DTYPES, 1, f"(M,) = ({m},)")
    _check_tensor(op, "b_scale", b_scale, FLOAT_DTYPES, 1, f"(N,) = ({n},)")
    for name, t, length in (("a_scale", a_scale, m), ("b_scale", b_scale, n)):
        if t.shape[0] != length:
            raise ValueError(f"{op}: `{name}` must have shape ({length},), got {tuple(t.shape)}")
    tensors = {"b": b, "a_scale": a_scale, "b_scale": b_scale}
    if bias is not None:
        _check_tensor(op, "bias", bias, FLOAT_DTYPES, 1, f"(N,) = ({n},)")
        if bias.shape[0] != n:
            raise ValueError(f"{op}: `bias` must have shape ({n},), got {tuple(bias.shape)}")
        tensors["bias"] = bias
    if out is not None:
        _check_tensor(op, "out", out, FLOAT_DTYPES, 2, f"(M, N) = ({m}, {n})")
        if out.shape != (m, n):
            raise ValueError(f"{op}: `out` must have shape ({m}, {n}), got {tuple(out.shape)}")
        tensors["out"] = out
    for name, t in tensors.items():
        checks.same_device(op, name, t, "a", a)


def check_matmul_quantize_inputs(
    x: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad argument of the quantizing GEMM."""
    op = "int8_matmul_quantize"
    _check_tensor(op, "x", x, FLOAT_DTYPES, 2, "(M, K); reshape(-1, K) first")
    _check_tensor(op, "b", b, (torch.int8,), 2, "(K, N)")
    k, n = x.shape[1], b.shape[1]
    if b.shape[0] != k:
        raise ValueError(
            f"{op}: `b` must have K = x.shape[1] = {k} rows, got shape {tuple(b.shape)}"
        )
    _check_tensor(op, "b_scale", b_scale, FLOAT_DTYPES, 1, f"(N,) = ({n},)")
    if b_scale.shape[0] != n:
        raise ValueError(f"{op}: `b_scale` must have shape ({n},), got {tuple(b_scale.shape)}")
    if bias is not None:
        _check_tensor(op, "bias", bias, FLOAT_DTYPES, 1, f"(N,) = ({n},)")
        if bias.shape[0] != n:
            raise ValueError(f"{op}: `bias` must have shape ({n},), got {tuple(bias.shape)}")
    for name, t in (("b", b), ("b_scale", b_scale), ("bias", bias)):
        checks.same_device(op, name, t, "x", x)


def can_synchronize(t: torch.Tensor) -> bool:
    """Whether a check may read a value of ``t`` back to the host: not while a CUDA graph is
    being captured (the copy would break the capture) nor while torch.compile traces (the
    value does not exist yet)."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_finite_rows(op: str, name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first row of ``x`` (M, K) that holds a NaN or an Inf.

    The opt-in refusal (``check_finite=True``); by default such a row quantizes to a NaN scale
    instead. It synchronizes with the device, so it is skipped where it cannot
    (:func:`can_synchronize`).
    """
    if x.dim() == 0 or x.numel() == 0 or not can_synchronize(x):
        return  # (a 0-d x is refused by the op's own checks, naming it)
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    bad_rows = (~torch.isfinite(rows)).any(dim=1).nonzero()  # (bad, 1)
    if len(bad_rows):
        row = int(bad_rows[0, 0])
        raise ValueError(
            f"{op}: `{name}` must be finite (check_finite=True), got a NaN or Inf in row {row} "
            f"of {len(bad_rows)} such row(s); with check_finite=False such a row gets a NaN "
            "scale and NaN outputs"
        )


# --- launchers -----------------------------------------------------------------------------------


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's implementation (CPU and CUDA kernels of the op)."""
    check_quantize_input(x)
    return _quantize_checked(x)


def _quantize_checked(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not x.is_cuda and not CPU_RUNS_TRITON:
        return quantize_int8_perrow_reference(x)
    m, k = x.shape
    q = torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format)  # (M, K)
    scale = x.new_empty((m,))  # (M,)
    if m == 0:
        return q, scale
    if k == 0:
        return q, scale.zero_()
    config = tuning.quantize_config(m, k)
    launch(
        quantize_int8_perrow_kernel,
        cdiv(m, config.block_m),
        (x, q, scale, m, k, x.stride(0), x.stride(1), q.stride(0)),
        {
            "BLOCK_M": config.block_m,
            "BLOCK_K": config.block_k,
            "ONE_PASS": config.one_pass,
            "PRECISE": x.is_cuda,
        },
        num_warps=config.num_warps,
    )
    return q, scale


@functools.cache
def _has_tma(device: torch.device) -> bool:
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return CPU_RUNS_TRITON  # the interpreter emulates the copy engine
    return torch.cuda.get_device_capability(device)[0] >= 9


def _aligned(t: torch.Tensor, row_stride: int) -> bool:
    # The copy engine needs 16-byte aligned base addresses and row strides.
    return t.data_ptr() % 16 == 0 and (row_stride * t.element_size()) % 16 == 0


def tma_applies(
    config: tuning.MatmulConfig, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor
) -> bool:
    """Whether ``config`` can run on these operands: TMA configs need Hopper (or the
    interpreter), row-major ``a`` and column-major ``b`` with 16-byte aligned rows (K a
    multiple of 16), an int32-exact K, and for ``tma_store`` a row-major, aligned ``out``."""
    if not config.tma:
        return True
    k = a.shape[1]
    usable = (
        _has_tma(a.device)
        and 0 < k <= MAX_K_PER_SPLIT
        and a.stride(1) == 1
        and b.stride(0) == 1
        and _aligned(a, a.stride(0))
        and _aligned(b, b.stride(1))
    )
    if config.tma_store:
        usable = usable and out.stride(1) == 1 and _aligned(out, out.stride(0))
    return usable


def split_k_ranges(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) for a K of ``k``: each split a multiple of ``block_k`` long and at
    most ``MAX_K_PER_SPLIT``, so a long K gets more splits than the config asks for."""
    per_split = cdiv(cdiv(max(k, 1), split_k), block_k) * block_k
    per_split = min(per_split, max(block_k, MAX_K_PER_SPLIT // block_k * block_k))
    return cdiv(max(k, 1), per_split), per_split


def launch_matmul(
    config: tuning.MatmulConfig,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Run the GEMM with one configuration into ``out`` (M, N): ``(a @ b) * a_scale[:, None] *
    b_scale (+ bias)``. Inputs already checked, scales and bias contiguous, and
    ``tma_applies(config, a, b, out)``."""
    (m, k), n = a.shape, b.shape[1]
    bias_arg = bias if bias is not None else b_scale  # never read without HAS_BIAS
    blocks = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "GROUP_M": config.group_m,
    }
    # enable_fp_fusion=False keeps `* a_scale * b_scale + bias` rounded as eager rounds it
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=False)
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    if config.tma:
        grid = min(tiles, sm_count(a.device) if a.is_cuda else 4)  # 4: the interpreter
        a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
        b_desc = TensorDescriptor.from_tensor(b.t(), [config.block_n, config.block_k])  # (N, K)
        c_block = [config.block_m, config.block_n // 2]
        c_desc = TensorDescriptor.from_tensor(out, c_block) if config.tma_store else a_desc
        sizes: tuple[int, ...] = (m, n, k, grid, out.stride(0), out.stride(1))
        args: tuple = (a_desc, b_desc, c_desc, out, a_scale, b_scale, bias_arg, *sizes)
        constexprs = blocks | {
            "HAS_BIAS": bias is not None,
            "TMA_STORE": config.tma_store,
            "SWAP_AB": config.swap_ab,
        }
        launch(perrow_w8a8_matmul_tma_kernel, grid, args, constexprs, **options)
        return
    splits, per_split = split_k_ranges(k, config.block_k, config.split_k)
    target, strides = out, (0, out.stride(0), out.stride(1))
    if splits > 1:  # int32 partials, summed by the epilogue kernel
        target, strides = a.new_empty((splits, m, n), dtype=torch.int32), (m * n, n, 1)
    sizes = (m, n, k, per_split, a.stride(0), a.stride(1), b.stride(0), b.stride(1), *strides)
    args = (a, b, target, a_scale, b_scale, bias_arg, *sizes)
    constexprs = blocks | {
        "PARTIALS": splits > 1,
        "EVEN_K": k % config.block_k == 0,
        "HAS_BIAS": bias is not None,
    }
    launch(perrow_w8a8_matmul_kernel, (tiles, splits), args, constexprs, **options)
    if splits > 1:
        block_m, block_n = 32, 128
        launch(
            splitk_epilogue_kernel,
            (cdiv(m, block_m), cdiv(n, block_n)),
            (target, out, a_scale, b_scale, bias_arg, m, n, splits, m * n,
             out.stride(0), out.stride(1)),
            {"BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_BIAS": bias is not None},
            enable_fp_fusion=False,
        )  # fmt: skip


def _matmul_into(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """The GEMM into ``out``, with the tuner's configuration for this product."""
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0:
        return
    if not a.is_cuda and not CPU_RUNS_TRITON:
        out.copy_(matmul_int8_reference(a, a_scale, b, b_scale, bias, out.dtype))
        return
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    # Everything the choice of configuration depends on: M's bucket, N, K, the layouts, the
    # dtypes and which operands the copy engine can address.
    key = (
        tuning.m_bucket(m), n, k, a.stride(), b.stride(), out.stride(),
        out.dtype, a_scale.dtype, b_scale.dtype, None if bias is None else bias.dtype, a.device,
        a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0,
    )  # fmt: skip
    config = tuning.tuned(
        key,
        lambda: [c for c in tuning.matmul_candidates(m, n, k) if tma_applies(c, a, b, out)],
        lambda c: launch_matmul(c, a, a_scale, b, b_scale, bias, out),
        a.device,
    )
    launch_matmul(config, a, a_scale, b, b_scale, bias, out)


def matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GEMM's implementation (CPU and CUDA kernels of ``int8_matmul``)."""
    check_matmul_inputs(a, a_scale, b, b_scale, bias)
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=a_scale.dtype)
    _matmul_into(a, a_scale, b, b_scale, bias, out)
    return out


def matmul_out(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """The implementation of ``int8_matmul_out``."""
    check_matmul_inputs(a, a_scale, b, b_scale, bias, out)
    _matmul_into(a, a_scale, b, b_scale, bias, out)


def matmul_quantize(
    x: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The implementation of ``int8_matmul_quantize``: the quantizer, then the GEMM, behind one
    op call (one trip below autograd, or through the dispatcher, instead of two).

    A one-launch variant for decode, each program quantizing all the rows itself, was measured
    and dropped (DECISIONS.md): recomputing the quantization in every program cost more GPU time
    than the second launch saves."""
    check_matmul_quantize_inputs(x, b, b_scale, bias)  # covers both steps' arguments
    q, scale = _quantize_checked(x)  # (M, K) int8, (M,) in x's dtype
    out = x.new_empty((x.shape[0], b.shape[1]))
    _matmul_into(q, scale, b, b_scale, bias, out)
    return out


# --- registration --------------------------------------------------------------------------------


def _quantize_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_quantize_input(x)
    q = x.new_empty(x.shape, dtype=torch.int8)
    return q, x.new_empty(x.shape[:1])


def _matmul_fake(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    check_matmul_inputs(a, a_scale, b, b_scale, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=a_scale.dtype)


def _matmul_out_fake(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    check_matmul_inputs(a, a_scale, b, b_scale, bias, out)


def _matmul_quantize_fake(
    x: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    check_matmul_quantize_inputs(x, b, b_scale, bias)
    return x.new_empty((x.shape[0], b.shape[1]))


def inference_only_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} is inference-only: llmsys.kernels_int8 has no backward. Run it under "
        "torch.no_grad() or torch.inference_mode(), or pass detached tensors."
    )


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
int8_quantize_perrow = define_op(
    _lib,
    "int8_quantize_perrow(Tensor x) -> (Tensor, Tensor)",
    quantize,
    _quantize_fake,
    replays=True,
)
int8_matmul = define_op(
    _lib,
    "int8_matmul(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor? bias=None) -> Tensor",
    matmul,
    _matmul_fake,
    replays=True,
)
int8_matmul_out = define_op(
    _lib,
    "int8_matmul_out(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor? bias, "
    "Tensor(a!) out) -> ()",
    matmul_out,
    _matmul_out_fake,
    replays=True,
)
int8_matmul_quantize = define_op(
    _lib,
    "int8_matmul_quantize(Tensor x, Tensor b, Tensor b_scale, Tensor? bias=None) -> Tensor",
    matmul_quantize,
    _matmul_quantize_fake,
    replays=True,
)
