"""Where tests and benchmarks run: the CUDA GPU if there is one, else the CPU, with Triton's
kernels under its interpreter.

Import this before any kernel module imports Triton (the root conftest.py and tools/bench.py
do): the interpreter is chosen when Triton is first imported.
"""

import os

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
