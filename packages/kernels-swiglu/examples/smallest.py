"""The smallest use of llmsys-kernels-swiglu: one fused SwiGLU, checked against eager."""

import torch
import torch.nn.functional as F

import llmsys.kernels_swiglu as ks
from llmsys.kernels_swiglu.kernels import swiglu_fwd_kernel
from llmsys.triton_launch import kernel_path

device = "cuda" if torch.cuda.is_available() else "cpu"
a = torch.randn(4, 33, device=device, requires_grad=True)
b = torch.randn(4, 33, device=device, requires_grad=True)

out = ks.swiglu(a, b)  # also torch.ops.llm_scaling_week.swiglu_fwd(a, b)
out.sum().backward()
torch.testing.assert_close(out, F.silu(a) * b)
ran = kernel_path(swiglu_fwd_kernel, device)  # Triton, interpreted Triton, or the fallback
print(
    f"swiglu ok: {tuple(out.shape)} {out.dtype} on {device}",
    f"| ran: {ran} | version {ks.__version__}",
)
