"""The smallest use of llmsys-triton-launch: launch a Triton kernel twice, the second time lean.

On a machine without a GPU it runs under Triton's interpreter when TRITON_INTERPRET=1 is set and
otherwise only reports that there is nothing to launch on.
"""

import os

import torch

from llmsys.triton_launch import kernel_path, launch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    print("no GPU and TRITON_INTERPRET is not 1: nothing to launch on")
    raise SystemExit(0)

import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)


device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(1000, device=device)
out = torch.empty_like(x)
for _ in range(2):  # the first call compiles, the second calls the compiled kernel
    launch(add_one, triton.cdiv(x.numel(), 256), (x, out, x.numel()), {"BLOCK": 256})
torch.testing.assert_close(out, x + 1)
print("triton-launch ok on", device, "| ran:", kernel_path(add_one, device))
