"""The smallest use of llmsys-flash-attn2: causal grouped-query attention, checked vs the spec."""

import torch

import llmsys.flash_attn2 as fa
from llmsys.flash_attn2.kernels import attn_fwd_kernel
from llmsys.triton_launch import kernel_path

device = "cuda" if torch.cuda.is_available() else "cpu"
q = torch.randn(2, 8, 77, 64, device=device, requires_grad=True)  # (batch, heads, seq, head_dim)
k = torch.randn(2, 2, 77, 64, device=device, requires_grad=True)  # 2 kv heads: groups of 4
v = torch.randn(2, 2, 77, 64, device=device, requires_grad=True)

out = fa.flash_attention(q, k, v, causal=True)
out.sum().backward()
expected, _ = fa.attention_reference(q, k, v, is_causal=True)
torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
ran = kernel_path(attn_fwd_kernel, device)  # Triton, interpreted Triton, or the fallback
print(
    f"flash_attention ok: {tuple(out.shape)} {out.dtype} on {device}",
    f"| ran: {ran} | version {fa.__version__}",
)
