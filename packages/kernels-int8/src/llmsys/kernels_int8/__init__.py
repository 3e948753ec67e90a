"""Per-row INT8 quantization and a W8A8 int8 tensor-core GEMM in Triton, for inference.

``quantize_model``, which serves a Hugging Face Llama-, Mistral- or Qwen2-family model with its
decoder layers fused on these kernels, lives in ``llmsys.hf`` (package llmsys-hf); it is
importable from here too, loaded when first asked for.

Importing this package registers ``torch.ops.llmsys.int8_quantize_perrow``,
``torch.ops.llmsys.int8_matmul``, ``torch.ops.llmsys.int8_matmul_out``,
``torch.ops.llmsys.int8_silu_mul_quantize`` and ``torch.ops.llmsys.int8_rms_norm_quantize``.
"""

from typing import Any

from .functional import matmul_int8, matmul_quantize_int8, quantize_int8, quantize_int8_perrow
from .kernels import perrow_w8a8_matmul_kernel, quantize_int8_perrow_kernel
from .modules import Int8Linear, quantize_linears
from .reference import (
    matmul_int8_reference,
    matmul_quantize_int8_reference,
    quantize_int8_perrow_reference,
    quantize_int8_reference,
    rms_norm_quantize_int8_reference,
    silu_mul_quantize_int8_reference,
    w8a8_reference_model,
)
from .rms_norm_quantize import rms_norm_quantize_int8, rms_norm_quantize_int8_kernel
from .silu_mul_quantize import silu_mul_quantize_int8, silu_mul_quantize_int8_kernel

__version__ = "0.1.0"

__all__ = [
    "Int8Linear",
    "__version__",
    "matmul_int8",
    "matmul_int8_reference",
    "matmul_quantize_int8",
    "matmul_quantize_int8_reference",
    "perrow_w8a8_matmul_kernel",
    "quantize_int8",
    "quantize_int8_perrow",
    "quantize_int8_perrow_kernel",
    "quantize_int8_perrow_reference",
    "quantize_int8_reference",
    "quantize_linears",
    "rms_norm_quantize_int8",
    "rms_norm_quantize_int8_kernel",
    "rms_norm_quantize_int8_reference",
    "silu_mul_quantize_int8",
    "silu_mul_quantize_int8_kernel",
    "silu_mul_quantize_int8_reference",
    "w8a8_reference_model",
]


def __getattr__(name: str) -> Any:
    # Model surgery needs transformers and lives in llmsys-hf, which depends on this package:
    # imported only when asked for, so this package installs and imports without either.
    if name == "quantize_model":
        try:
            from llmsys.hf import quantize_model
        except ImportError as error:
            raise ImportError(
                "llmsys.kernels_int8.quantize_model lives in llmsys-hf now: pip install llmsys-hf "
                "(then `from llmsys.hf import quantize_model`)"
            ) from error
        return quantize_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
