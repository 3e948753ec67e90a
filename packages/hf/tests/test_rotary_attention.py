"""``rotary_attention_forward`` bound to a tiny Llama's attentions gives stock's logits, with and
without a KV cache (apply_llmsys binds it; quantize_model's attention runs the same
``rotary_attention`` on its fused projection's columns)."""

import copy
from types import MethodType

import pytest
import torch

from llmsys.hf import rotary_attention_forward

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("use_cache", [True, False])
def test_bound_attention_gives_stock_logits(use_cache):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=61, max_position_embeddings=32,
    )  # fmt: skip
    stock = transformers.LlamaForCausalLM(config).eval()
    ours = copy.deepcopy(stock)
    for layer in ours.model.layers:
        layer.self_attn.forward = MethodType(rotary_attention_forward, layer.self_attn)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = stock(ids, use_cache=use_cache).logits
        got = ours(ids, use_cache=use_cache).logits
    assert not torch.equal(got, torch.zeros_like(got))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
