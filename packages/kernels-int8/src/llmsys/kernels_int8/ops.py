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
from contextlib import nullcontext

import torch

from llmsys.triton_launch import (
    Launch,
    cdiv,
    checks,
    define_op,
    runs_under_interpreter,
    sm_count,
)

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


def _check_tensor(op: str, name: str, t, dtypes, dim: int, shape_doc: str) -> None:
    checks.tensor(op, name, t, dtypes)
    if t.dim() != dim:
        raise ValueError(f"{op}: `{name}` must be {dim}-D {shape_doc}, got shape {tuple(t.shape)}")


def check_quantize_input(x) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``x`` unless it is a 2-D float tensor."""
    _check_tensor("int8_quantize_perrow", "x", x, FLOAT_DTYPES, 2, "(M, K); reshape(-1, K) first")


_Tensor = torch.Tensor


def _plainly_valid(a, a_scale, b, b_scale, bias, out) -> bool:
    """The GEMM's arguments are valid, tested in a few comparisons (every call's path); False
    leaves it to the full check to name what is wrong."""
    if not (
        type(a) is _Tensor
        and type(b) is _Tensor
        and type(a_scale) is _Tensor
        and type(b_scale) is _Tensor
        and a.dtype is torch.int8
        and b.dtype is torch.int8
        and a_scale.dtype in FLOAT_DTYPES
        and b_scale.dtype in FLOAT_DTYPES
        and a.dim() == 2
        and b.dim() == 2
        and a_scale.dim() == 1
        and b_scale.dim() == 1
    ):
        return False
    (m, k), (k_b, n) = a.shape, b.shape
    device = a.device
    return (
        k_b == k
        and a_scale.shape[0] == m
        and b_scale.shape[0] == n
        and b.device == device
        and a_scale.device == device
        and b_scale.device == device
        and (
            bias is None
            or (
                type(bias) is _Tensor
                and bias.dtype in FLOAT_DTYPES
                and bias.shape == (n,)
                and bias.device == device
            )
        )
        and (
            out is None
            or (
                type(out) is _Tensor
                and out.dtype in FLOAT_DTYPES
                and out.shape == (m, n)
                and out.device == device
            )
        )
    )


def check_matmul_inputs(a, a_scale, b, b_scale, bias, out=None) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad argument of the GEMM."""
    if _plainly_valid(a, a_scale, b, b_scale, bias, out):
        return
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


def check_matmul_quantize_inputs(x, b, b_scale, bias) -> None:
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
    if x.numel() == 0 or not can_synchronize(x):
        return
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
    QuantizePlan(x)(x, q, scale)
    return q, scale


class QuantizePlan:
    """The quantizer's launch for one (M, K) and x's row stride, built once: a call only
    launches."""

    __slots__ = ("grid", "kernel", "sizes")

    def __init__(self, x: torch.Tensor):
        m, k = x.shape
        config = tuning.quantize_config(m, k)
        self.grid = cdiv(m, config.block_m)
        self.sizes = (m, k, x.stride(0), x.stride(1), k)  # then q's row stride: q is (M, K)
        constexprs = {
            "BLOCK_M": config.block_m,
            "BLOCK_K": config.block_k,
            "ONE_PASS": config.one_pass,
            "PRECISE": x.is_cuda,
        }
        self.kernel = Launch(quantize_int8_perrow_kernel, constexprs, config.num_warps)

    def __call__(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.kernel(self.grid, (x, q, scale, *self.sizes))


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


def tma_applies(config: tuning.MatmulConfig, a, b, out) -> bool:
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


def split_plan(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split) for a K of ``k``: each split a multiple of ``block_k`` long and at
    most ``MAX_K_PER_SPLIT``, so a long K gets more splits than the config asks for."""
    per_split = cdiv(cdiv(max(k, 1), split_k), block_k) * block_k
    per_split = min(per_split, max(block_k, MAX_K_PER_SPLIT // block_k * block_k))
    return cdiv(max(k, 1), per_split), per_split


class MatmulPlan:
    """The GEMM with one configuration for one product: its launches built once (kernel,
    constexprs, grid, sizes and strides), so a call only allocates what it must (split-K
    partials, tensor descriptors) and launches. Built from the operands (M, K) ``a``, (K, N)
    ``b`` and (M, N) ``out``, whose shapes and strides every call must share; it holds no
    tensor."""

    __slots__ = ("blocks", "epilogue", "grid", "kernel", "partials", "sizes", "tma", "tma_store")

    def __init__(self, config: tuning.MatmulConfig, a, b, out, has_bias: bool):
        (m, k), n = a.shape, b.shape[1]
        self.tma, self.tma_store, self.partials = config.tma, config.tma_store, None
        constexprs = {
            "BLOCK_M": config.block_m,
            "BLOCK_N": config.block_n,
            "BLOCK_K": config.block_k,
            "GROUP_M": config.group_m,
        }
        tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
        if config.tma:
            self.blocks = (
                [config.block_m, config.block_k],  # a
                [config.block_n, config.block_k],  # b.T (N, K)
                [config.block_m, config.block_n // 2],  # out, when TMA_STORE
            )
            self.grid = min(tiles, sm_count(a.device) if a.is_cuda else 4)  # 4: the interpreter
            self.sizes = (m, n, k, self.grid, out.stride(0), out.stride(1))
            constexprs |= {
                "HAS_BIAS": has_bias,
                "TMA_STORE": config.tma_store,
                "SWAP_AB": config.swap_ab,
            }
            kernel = perrow_w8a8_matmul_tma_kernel
        else:
            splits, per_split = split_plan(k, config.block_k, config.split_k)
            self.grid = (tiles, splits)
            strides = (0, out.stride(0), out.stride(1))
            if splits > 1:
                self.partials = (splits, m, n)  # int32, summed by the epilogue kernel
                strides = (m * n, n, 1)
                block_m, block_n = 32, 128
                self.epilogue = (
                    Launch(
                        splitk_epilogue_kernel,
                        {"BLOCK_M": block_m, "BLOCK_N": block_n, "HAS_BIAS": has_bias},
                        enable_fp_fusion=False,
                    ),
                    (cdiv(m, block_m), cdiv(n, block_n)),
                    (m, n, splits, m * n, out.stride(0), out.stride(1)),
                )
            self.sizes = (
                m, n, k, per_split, a.stride(0), a.stride(1), b.stride(0), b.stride(1), *strides
            )  # fmt: skip
            constexprs |= {
                "PARTIALS": splits > 1,
                "EVEN_K": k % config.block_k == 0,
                "HAS_BIAS": has_bias,
            }
            kernel = perrow_w8a8_matmul_kernel
        # enable_fp_fusion=False keeps `* a_scale * b_scale + bias` rounded as eager rounds it
        self.kernel = Launch(
            kernel, constexprs, config.num_warps, config.num_stages, enable_fp_fusion=False
        )

    def __call__(self, a, a_scale, b, b_scale, bias, out) -> None:
        """``out = (a @ b) * a_scale[:, None] * b_scale + bias``; scales and bias contiguous."""
        bias_arg = bias if bias is not None else b_scale  # never read without HAS_BIAS
        if self.tma:
            a_desc = TensorDescriptor.from_tensor(a, self.blocks[0])
            b_desc = TensorDescriptor.from_tensor(b.t(), self.blocks[1])
            c_desc = TensorDescriptor.from_tensor(out, self.blocks[2]) if self.tma_store else a_desc
            args = (a_desc, b_desc, c_desc, out, a_scale, b_scale, bias_arg, *self.sizes)
            self.kernel(self.grid, args)
        elif self.partials is None:
            self.kernel(self.grid, (a, b, out, a_scale, b_scale, bias_arg, *self.sizes))
        else:
            target = a.new_empty(self.partials, dtype=torch.int32)
            self.kernel(self.grid, (a, b, target, a_scale, b_scale, bias_arg, *self.sizes))
            epilogue, grid, sizes = self.epilogue
            epilogue(grid, (target, out, a_scale, b_scale, bias_arg, *sizes))


def launch_matmul(config: tuning.MatmulConfig, a, a_scale, b, b_scale, bias, out) -> None:
    """Run the GEMM with one configuration into ``out`` (M, N); inputs already checked, and
    ``tma_applies(config, a, b, out)``."""
    MatmulPlan(config, a, b, out, bias is not None)(a, a_scale, b, b_scale, bias, out)


def _on(device: torch.device):
    """Make ``device`` current for the tuner's timing, when it is not already (entering
    ``torch.cuda.device`` costs microseconds on every call)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return nullcontext()


def _matmul_into(a, a_scale, b, b_scale, bias, out) -> MatmulPlan | None:
    """The GEMM into ``out``; returns its plan where the next call of this shape may reuse it
    (the configuration is final: tuned, or not tuned at all), else None."""
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0:
        return None
    if not a.is_cuda and not CPU_RUNS_TRITON:
        out.copy_(matmul_int8_reference(a, a_scale, b, b_scale, bias, out.dtype))
        return None
    a_scale, b_scale = a_scale.contiguous(), b_scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    # Everything the choice of configuration depends on: M's bucket, N, K, the layouts, the
    # dtypes and which operands the copy engine can address.
    key = (
        tuning.m_bucket(m),
        n,
        k,
        a.stride(),
        b.stride(),
        out.stride(),
        out.dtype,
        a_scale.dtype,
        b_scale.dtype,
        None if bias is None else bias.dtype,
        a.device,
        a.data_ptr() % 16 == 0,
        b.data_ptr() % 16 == 0,
        out.data_ptr() % 16 == 0,
    )
    plan_key = (key, m)  # a plan's grid is M's own
    plan = tuning.plans.get(plan_key)
    if plan is None:
        with _on(a.device):
            config = tuning.tuned(
                key,
                lambda: [c for c in tuning.matmul_candidates(m, n, k) if tma_applies(c, a, b, out)],
                lambda c: launch_matmul(c, a, a_scale, b, b_scale, bias, out),
                a.is_cuda,
            )
        plan = MatmulPlan(config, a, b, out, bias is not None)
        if tuning.is_final(key, a.is_cuda):
            tuning.remember(plan_key, plan)
    with _on(a.device):
        plan(a, a_scale, b, b_scale, bias, out)
    return plan if tuning.is_final(key, a.is_cuda) else None


def matmul(a, a_scale, b, b_scale, bias=None) -> torch.Tensor:
    """The GEMM's implementation (CPU and CUDA kernels of ``int8_matmul``)."""
    check_matmul_inputs(a, a_scale, b, b_scale, bias)
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=a_scale.dtype)
    _matmul_into(a, a_scale, b, b_scale, bias, out)
    return out


def matmul_out(a, a_scale, b, b_scale, bias, out) -> None:
    """The implementation of ``int8_matmul_out``."""
    check_matmul_inputs(a, a_scale, b, b_scale, bias, out)
    _matmul_into(a, a_scale, b, b_scale, bias, out)


def matmul_quantize(x, b, b_scale, bias=None) -> torch.Tensor:
    """The implementation of ``int8_matmul_quantize``: the quantizer, then the GEMM, behind one
    op call (one trip below autograd, or through the dispatcher, instead of two).

    The first call of a product decides everything (checks, quantizer and GEMM configurations,
    grids, sizes) and keeps it as a :class:`QuantizedMatmulPlan`; a later call whose operands
    share every property those decisions read (shapes, strides, dtypes, devices, the weight's
    alignment) only allocates and launches.

    A one-launch variant for decode, each program quantizing all the rows itself, was measured
    and dropped (DECISIONS.md): recomputing the quantization in every program cost more GPU time
    than the second launch saves."""
    try:
        key = (
            x.shape, x.stride(), x.dtype, x.get_device(),
            b.shape, b.stride(), b.dtype, b.get_device(), b.data_ptr() % 16 == 0,
            b_scale.shape, b_scale.stride(), b_scale.dtype, b_scale.get_device(),
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device()),
        )  # fmt: skip
    except AttributeError:  # not a tensor: the checks name it
        key = None
    plan = tuning.plans.get(key)
    if plan is not None:
        return plan(x, b, b_scale, bias)
    check_matmul_quantize_inputs(x, b, b_scale, bias)  # covers both steps' arguments
    q, scale = _quantize_checked(x)  # (M, K) int8, (M,) in x's dtype
    out = x.new_empty((x.shape[0], b.shape[1]))
    matmul_plan = _matmul_into(q, scale, b, b_scale, bias, out)
    if (
        matmul_plan is not None
        and x.shape[1] > 0
        and b_scale.is_contiguous()
        and (bias is None or bias.is_contiguous())
    ):
        tuning.remember(key, QuantizedMatmulPlan(x, b, matmul_plan))
    return out


class QuantizedMatmulPlan:
    """``int8_matmul_quantize`` decided for one product: allocate q, the scales and the output,
    then launch the quantizer and the GEMM's planned launches."""

    __slots__ = ("matmul", "out_shape", "q_shape", "quantize")

    def __init__(self, x: torch.Tensor, b: torch.Tensor, matmul: MatmulPlan):
        self.q_shape, self.out_shape = tuple(x.shape), (x.shape[0], b.shape[1])
        self.quantize, self.matmul = QuantizePlan(x), matmul

    def __call__(self, x, b, b_scale, bias) -> torch.Tensor:
        # The allocation forms measured cheapest on an H100 host (triton-launch DECISIONS.md):
        # each torch.empty(shape, dtype=, device=) cost about 1 us more.
        q = torch.empty_like(x, dtype=torch.int8, memory_format=torch.contiguous_format)
        scale = x.new_empty(self.q_shape[:1])  # (M,), x's dtype
        out = x.new_empty(self.out_shape)  # (M, N)
        self.quantize(x, q, scale)
        self.matmul(q, scale, b, b_scale, bias, out)
        return out


# --- registration --------------------------------------------------------------------------------


def _quantize_fake(x):
    check_quantize_input(x)
    q = x.new_empty(x.shape, dtype=torch.int8)
    return q, x.new_empty(x.shape[:1])


def _matmul_fake(a, a_scale, b, b_scale, bias=None):
    check_matmul_inputs(a, a_scale, b, b_scale, bias)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=a_scale.dtype)


def _matmul_out_fake(a, a_scale, b, b_scale, bias, out):
    check_matmul_inputs(a, a_scale, b, b_scale, bias, out)


def _matmul_quantize_fake(x, b, b_scale, bias=None):
    check_matmul_quantize_inputs(x, b, b_scale, bias)
    return x.new_empty((x.shape[0], b.shape[1]))


def inference_only_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} is inference-only: llmsys.kernels_int8 has no backward. Run it under "
        "torch.no_grad() or torch.inference_mode(), or pass detached tensors."
    )


_lib = torch.library.Library(NAMESPACE, "FRAGMENT")
int8_quantize_perrow = define_op(
    _lib, "int8_quantize_perrow(Tensor x) -> (Tensor, Tensor)", quantize, _quantize_fake
)
int8_matmul = define_op(
    _lib,
    "int8_matmul(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor? bias=None) -> Tensor",
    matmul,
    _matmul_fake,
)
int8_matmul_out = define_op(
    _lib,
    "int8_matmul_out(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor? bias, "
    "Tensor(a!) out) -> ()",
    matmul_out,
    _matmul_out_fake,
)
int8_matmul_quantize = define_op(
    _lib,
    "int8_matmul_quantize(Tensor x, Tensor b, Tensor b_scale, Tensor? bias=None) -> Tensor",
    matmul_quantize,
    _matmul_quantize_fake,
)
