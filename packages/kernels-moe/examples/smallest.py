"""The smallest use of llmsys-kernels-moe: the issue's example, permuted and combined back."""

import torch

import llmsys.kernels_moe as km
from llmsys.kernels_moe.kernels import moe_permute_kernel
from llmsys.triton_launch import kernel_path

device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(4, 8, device=device, requires_grad=True)  # 4 tokens, hidden 8
top_experts = torch.tensor([[1, 3], [2, 5], [3, 5], [2, 4]], device=device)  # top-2 of 6 experts
tokens_per_expert = torch.bincount(top_experts.flatten(), minlength=6)  # [0, 1, 2, 2, 1, 2]

grouped, padded, row_index = km.padded_moe_permute(
    x, top_experts, tokens_per_expert, topk=2, num_experts=6, return_row_index=True
)
assert padded.tolist() == [0, 128, 128, 128, 128, 128] and grouped.shape == (640, 8)
assert torch.equal(grouped[128], x[1]) and torch.equal(grouped[129], x[3])

weights = torch.softmax(torch.randn(4, 2, device=device), dim=-1)
y = km.moe_unpermute(grouped, row_index, weights)  # sum_k w[t, k] * grouped[row_index[t, k]]
y.sum().backward()
torch.testing.assert_close(y, x * weights.sum(1, keepdim=True))
ran = kernel_path(moe_permute_kernel, device)  # Triton, interpreted Triton, or the fallback
print(
    f"moe permute ok: {tuple(grouped.shape)} rows on {device}",
    f"| ran: {ran} | version {km.__version__}",
)
