"""A Transformer LM with switchable llmsys kernels, and the benchmarks that run it."""

from .config import SIZES, ModelConfig
from .infra.hardware import HARDWARE, HardwareSpec
from .model import TransformerLM, num_parameters, use_int8_linears

__version__ = "0.2.0"

__all__ = [
    "HARDWARE",
    "SIZES",
    "HardwareSpec",
    "ModelConfig",
    "TransformerLM",
    "__version__",
    "num_parameters",
    "use_int8_linears",
]
