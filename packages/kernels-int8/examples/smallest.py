"""The smallest use of llmsys-kernels-int8: quantize a layer, run it, compare with float."""

import torch
from torch import nn

import llmsys.kernels_int8 as ki
from llmsys.kernels_int8.kernels import quantize_int8_perrow_kernel
from llmsys.triton_launch import kernel_path

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.float32
layer = nn.Linear(256, 64, device=device, dtype=dtype)
x = torch.randn(4, 256, device=device, dtype=dtype)

q_x, x_scale = ki.quantize_int8_perrow(x)  # (4, 256) int8, (4,) scales
q_w, w_scale = ki.quantize_int8(layer.weight.detach().t())  # (256, 64) column-major, (64,)
y = ki.matmul_int8(q_x, x_scale, q_w, w_scale, bias=layer.bias.detach())
torch.testing.assert_close(y, ki.matmul_int8_reference(q_x, x_scale, q_w, w_scale, layer.bias))

with torch.inference_mode():
    int8_layer = ki.Int8Linear.from_float(layer)
    error = (int8_layer(x) - layer(x)).abs().max().item()
ran = kernel_path(quantize_int8_perrow_kernel, device)
print(
    f"int8 ok: {tuple(y.shape)} {y.dtype} on {device}, max |int8 - float| = {error:.4f}",
    f"| ran: {ran} | version {ki.__version__}",
)
assert error < 0.05
