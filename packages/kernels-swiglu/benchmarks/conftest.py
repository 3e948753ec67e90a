import os

import torch

# Before the package imports triton: run the kernels on CPU tensors (as tests/conftest.py does).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
