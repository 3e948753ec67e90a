"""Tiny Llama, Mistral and Qwen2 models (random weights) and a batch, shared by the hf tests."""

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=97,
    max_position_embeddings=64,
    attn_implementation="sdpa",
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def build(family: str, **overrides) -> nn.Module:
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**(TINY | overrides)))
    with torch.no_grad():  # norm gains and biases away from their initial ones and zeros
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def batch(vocab: int = 97, ignored: bool = True):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 9), generator=generator)
    labels = tokens.clone()
    if ignored:
        labels[0, :3] = -100  # a prompt the loss ignores
    return tokens, labels
