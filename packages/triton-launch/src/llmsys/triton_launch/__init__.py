"""One way to launch Triton kernels and register them as ``torch.ops``, shared by the kernel
packages: ``launch`` (a compiled kernel without ``JITFunction.run``'s per-call host cost),
``define_op`` (the op's registration), ``wants_grad`` and ``call_below_autograd`` (how a package
calls its ops), ``checks`` (argument checks whose errors name the argument), ``precise``
(``exp``/``log`` that round as eager's CUDA kernels) and ``sm_count``. An op's eager calls
replay a recorded plan in C++ after its first calls (``plans``); ``forget`` and ``disabled``
switch that per op or per block."""

from . import checks, precise
from .launcher import (
    cdiv,
    kernel_path,
    launch,
    next_power_of_2,
    runs_under_interpreter,
    sm_count,
)
from .library import (
    call_below_autograd,
    define_op,
    disabled,
    forget,
    refuse_double_backward,
    wants_grad,
)

__version__ = "0.8.0"

__all__ = [
    "__version__",
    "call_below_autograd",
    "cdiv",
    "checks",
    "define_op",
    "disabled",
    "forget",
    "kernel_path",
    "launch",
    "next_power_of_2",
    "precise",
    "refuse_double_backward",
    "runs_under_interpreter",
    "sm_count",
    "wants_grad",
]
