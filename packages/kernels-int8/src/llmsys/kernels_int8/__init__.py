"""Per-row INT8 quantization and a W8A8 int8 tensor-core GEMM in Triton, for inference.

``quantize_model`` serves a Hugging Face Llama-, Mistral- or Qwen2-family model with its decoder
layers fused (RMSNorm and SiLU-and-mul write the int8 rows the next GEMM reads).

Importing this package registers ``torch.ops.llmsys.int8_quantize_perrow``,
``torch.ops.llmsys.int8_matmul``, ``torch.ops.llmsys.int8_matmul_out``,
``torch.ops.llmsys.int8_silu_mul_quantize`` and ``torch.ops.llmsys.int8_rms_norm_quantize``.
"""

from .functional import matmul_int8, matmul_quantize_int8, quantize_int8, quantize_int8_perrow
from .kernels import perrow_w8a8_matmul_kernel, quantize_int8_perrow_kernel
from .model import ProjectionSlice, quantize_model
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
    "ProjectionSlice",
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
    "quantize_model",
    "rms_norm_quantize_int8",
    "rms_norm_quantize_int8_kernel",
    "rms_norm_quantize_int8_reference",
    "silu_mul_quantize_int8",
    "silu_mul_quantize_int8_kernel",
    "silu_mul_quantize_int8_reference",
    "w8a8_reference_model",
]
