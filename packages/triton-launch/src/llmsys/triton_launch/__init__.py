"""One way to launch Triton kernels and register them as ``torch.ops``, shared by the kernel
packages: ``launch`` (a compiled kernel without ``JITFunction.run``'s per-call host cost),
``define_op`` and ``register_autograd`` (the op's registration), and ``checks`` (argument checks
whose errors name the argument)."""

from . import checks
from .launcher import cdiv, launch, next_power_of_2, runs_under_interpreter
from .library import call_below_autograd, define_op, register_autograd

__version__ = "0.2.0"

__all__ = [
    "__version__",
    "call_below_autograd",
    "cdiv",
    "checks",
    "define_op",
    "launch",
    "next_power_of_2",
    "register_autograd",
    "runs_under_interpreter",
]
