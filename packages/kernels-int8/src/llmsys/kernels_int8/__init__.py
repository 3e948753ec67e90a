"""Per-row INT8 quantization and a W8A8 int8 tensor-core GEMM in Triton, for inference.

Importing this package registers ``torch.ops.llmsys.int8_quantize_perrow``,
``torch.ops.llmsys.int8_matmul`` and ``torch.ops.llmsys.int8_matmul_out``.
"""

from .functional import matmul_int8, matmul_quantize_int8, quantize_int8, quantize_int8_perrow
from .kernels import perrow_w8a8_matmul_kernel, quantize_int8_perrow_kernel
from .modules import Int8Linear, quantize_linears
from .reference import (
    matmul_int8_reference,
    matmul_quantize_int8_reference,
    quantize_int8_perrow_reference,
    quantize_int8_reference,
)

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
]
