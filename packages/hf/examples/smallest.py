"""The smallest use of llmsys-hf: a tiny random Llama, its loss with and without apply_llmsys."""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmsys.hf import apply_llmsys

config = LlamaConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,
)
stock = LlamaForCausalLM(config)
model = copy.deepcopy(stock)
replaced = apply_llmsys(model)  # attention, MLP, RMSNorm, rotary and the fused loss

tokens = torch.randint(0, config.vocab_size, (2, 12))
loss = model(tokens, labels=tokens).loss  # no logits materialised
torch.testing.assert_close(loss, stock(tokens, labels=tokens).loss, atol=1e-5, rtol=1e-5)
loss.backward()
print(f"apply_llmsys ok: loss {loss.item():.4f};", {k: len(v) for k, v in replaced.items()})
