"""The smallest use of the package: a tiny Transformer LM, one training step, its loss."""

import torch

from llmsys.profiling import ModelConfig, TransformerLM, num_parameters
from llmsys.profiling.training import lm_loss, make_optimizer, random_batch

config = ModelConfig.named("tiny", context_length=32)  # SDPA attention, eager SwiGLU
model = TransformerLM(config)
optimizer = make_optimizer(model)
tokens, targets = random_batch(config, batch_size=2, seq_len=32, device="cpu")
loss = lm_loss(model(tokens), targets)
loss.backward()
optimizer.step()
assert torch.isfinite(loss)
print(f"ok: {num_parameters(model):,} parameters, loss {loss.item():.3f}")
