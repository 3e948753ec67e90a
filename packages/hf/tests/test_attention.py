"""``attn_implementation="llmsys_fa2"`` in Hugging Face transformers models: tiny random
models against the stock model in float64 (logits, every parameter's gradient, decoding over a
cache), and every input the kernel cannot compute refused with its reason."""

import pytest
import torch

from llmsys.hf import attention as hf_attention
from llmsys_dev.compare import assert_matches_stock, logits_and_grads, relative_error

transformers = pytest.importorskip("transformers")

NAME = hf_attention.register_flash_attention()
VOCAB, LAYERS, HEADS, KV_HEADS = 97, 2, 4, 2
# float32 against the float64 stock model; CUDA float32 runs TF32 dots (10-bit mantissa)
TOL = {"cpu": 1e-4, "cuda": 1e-2}


def tiny_config(family: str = "llama", **overrides):
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,  # head_dim 16
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    configs = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,  # sliding_window 4096 by default
        "qwen2": transformers.Qwen2Config,  # q/k/v biases
    }
    return configs[family](**(sizes | overrides))


def model_pair(device, family="llama", **overrides):
    """(ours in float32, the stock eager model in float64), same random weights."""
    build = transformers.AutoModelForCausalLM.from_config  # a config each: models share theirs
    stock = build(tiny_config(family, **overrides), attn_implementation="eager")
    ours = build(tiny_config(family, **overrides), attn_implementation=NAME)
    ours.load_state_dict(stock.state_dict())
    return ours.to(device).eval(), stock.to(device, torch.float64).eval()


@pytest.fixture
def calls(monkeypatch):
    """The shapes (q, k) of every flash_attention call the models make."""
    seen, flash_attention = [], hf_attention.flash_attention

    def spy(q, k, v, causal=False, scale=None):
        assert q.dtype == k.dtype == v.dtype
        seen.append((tuple(q.shape), tuple(k.shape), causal))
        return flash_attention(q, k, v, causal, scale)

    monkeypatch.setattr(hf_attention, "flash_attention", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_logits_and_gradients_match_the_stock_model(family, device, calls):
    ours, stock = model_pair(device, family)
    ids = torch.randint(0, VOCAB, (2, 13), device=device)
    weight = torch.randn(2, 13, VOCAB, device=device)  # a random linear loss of the logits

    tol = TOL[torch.device(device).type]
    got, want = logits_and_grads(ours, ids, weight), logits_and_grads(stock, ids, weight)
    assert_matches_stock(got, want, tol)
    # one causal call per layer; the 2 key/value heads go in as they are (no repeat_kv copy)
    assert calls == [((2, HEADS, 13, 16), (2, KV_HEADS, 13, 16), True)] * LAYERS


def test_under_autocast_it_runs_in_the_autocast_dtype(device, calls):
    ours, stock = model_pair(device)
    stock.float()
    ids = torch.randint(0, VOCAB, (2, 11), device=device)
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        got, want = ours(ids).logits, stock(ids).logits
    assert torch.isfinite(got).all() and relative_error(got, want) < 3e-2  # bf16
    assert len(calls) == LAYERS


def test_under_torch_compile_the_causal_pattern_is_checked_not_assumed(device, calls):
    # Tracing, transformers cannot rule out packed sequences and hands over its mask pattern.
    ours, _ = model_pair(device)
    ids = torch.randint(0, VOCAB, (2, 7), device=device)
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="eager")
    ones = torch.ones_like(ids)
    with torch.no_grad():
        want = ours(ids, use_cache=False).logits
        assert torch.equal(compiled(ids, use_cache=False).logits, want)
        assert torch.equal(compiled(ids, attention_mask=ones, use_cache=False).logits, want)
        with pytest.raises(ValueError, match="packed sequences"):
            forward_with_packed_sequences(compiled, ids)
        with pytest.raises(ValueError, match="padded positions"):
            forward_with_padding(compiled, ids)
    torch._dynamo.reset()


def test_from_pretrained_and_from_config_use_it(tmp_path, calls):
    stock = transformers.AutoModelForCausalLM.from_config(tiny_config())
    stock.save_pretrained(tmp_path)  # local files only, no download
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    built = transformers.AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=NAME)
    ids = torch.randint(0, VOCAB, (1, 5))
    for model in (loaded, built):
        assert model.config._attn_implementation == NAME
        with torch.no_grad():
            model(ids)
    assert len(calls) == 2 * LAYERS


def test_decoding_one_token_over_a_dynamic_cache(device, calls):
    ours, stock = model_pair(device)
    ids = torch.randint(0, VOCAB, (2, 9), device=device)
    with torch.no_grad():
        prefill = ours(ids[:, :8], use_cache=True)
        step = ours(ids[:, 8:], past_key_values=prefill.past_key_values, use_cache=True)
        want = stock(ids).logits
    tol = TOL[torch.device(device).type]
    assert relative_error(prefill.logits, want[:, :8]) < tol
    assert relative_error(step.logits, want[:, 8:]) < tol
    # the new token's query sees all 9 keys: no causal mask for it
    assert calls[-1] == ((2, HEADS, 1, 16), (2, KV_HEADS, 9, 16), False)


def test_greedy_generate_picks_the_stock_models_best_token_every_step(device):
    ours, stock = model_pair(device)
    ids = torch.randint(0, VOCAB, (2, 6), device=device)
    options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(ids, attention_mask=torch.ones_like(ids), **options)
        # the float64 stock model's scores for each generated token, given the tokens before it
        scores = stock(got).logits[:, ids.shape[1] - 1 : -1]  # (2, 4, VOCAB)
    assert got.shape == (2, 10) and torch.equal(got[:, :6], ids)
    chosen = scores.gather(-1, got[:, 6:, None]).squeeze(-1)
    # Random weights give near-flat logits: where two tokens tie within float32's (TF32's on
    # CUDA) rounding, either is a correct greedy choice, so the check is the margin, not equality.
    margin = scores.max(-1).values - chosen
    assert (margin <= TOL[torch.device(device).type] * scores.abs().amax()).all(), margin


def test_an_all_ones_attention_mask_is_no_mask(device):
    ours, _ = model_pair(device)
    ids = torch.randint(0, VOCAB, (2, 7), device=device)
    with torch.no_grad():
        masked = ours(ids, attention_mask=torch.ones_like(ids)).logits
        plain = ours(ids).logits
    assert torch.equal(masked, plain)


def forward_with_padding(model, ids):
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of the first sequence
    return model(ids, attention_mask=mask)


def forward_with_packed_sequences(model, ids):
    positions = torch.cat([torch.arange(3), torch.arange(4)])[None].expand(ids.shape[0], -1)
    return model(ids, position_ids=positions.to(ids.device), use_cache=False)


def forward_over_a_static_cache(model, ids):
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    return model(ids, past_key_values=cache, use_cache=True)


def forward_two_tokens_over_a_cache(model, ids):
    past = model(ids[:, :5], use_cache=True).past_key_values
    return model(ids[:, 5:], past_key_values=past, use_cache=True)


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        (forward_with_padding, "padded positions"),
        (forward_with_packed_sequences, "packed sequences"),
        (forward_over_a_static_cache, "static KV cache"),
        (forward_two_tokens_over_a_cache, "2 new tokens over 5 cached ones"),
    ],
    ids=["padding", "packed", "static-cache", "chunked-prefill"],
)
def test_inputs_it_cannot_compute_are_refused(forward, reason, device):
    ours, _ = model_pair(device)
    ids = torch.randint(0, VOCAB, (2, 7), device=device)
    with torch.no_grad(), pytest.raises(ValueError, match=reason) as error:
        forward(ours, ids)
    assert "attn_implementation='sdpa'" in str(error.value)


def test_a_sliding_window_is_refused_only_where_it_masks(device):
    ours, stock = model_pair(device, "mistral", sliding_window=8)
    ids = torch.randint(0, VOCAB, (1, 9), device=device)
    with torch.no_grad():
        within = ours(ids[:, :8]).logits
        assert relative_error(within, stock(ids[:, :8]).logits) < TOL[torch.device(device).type]
        with pytest.raises(ValueError, match="sliding window or attention chunk of 8 tokens"):
            ours(ids)


def test_attention_dropout_is_refused(device):
    ours, _ = model_pair(device, attention_dropout=0.1)
    ours.train()
    with pytest.raises(ValueError, match=r"attention dropout 0\.1"):
        ours(torch.randint(0, VOCAB, (1, 4), device=device))


def test_the_attention_function_refuses_what_it_cannot_apply():
    layer = torch.nn.Module()
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    mask = torch.zeros(1, 1, 3, 3)
    with pytest.raises(ValueError, match=r"explicit attention mask of shape \(1, 1, 3, 3\)"):
        hf_attention.flash_attention_interface(layer, q, k, v, mask)
    with pytest.raises(ValueError, match="soft-capping"):
        hf_attention.flash_attention_interface(layer, q, k, v, None, softcap=30.0)
    with pytest.raises(ValueError, match="sinks"):
        hf_attention.flash_attention_interface(layer, q, k, v, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="bottom-right"):
        hf_attention.flash_attention_interface(
            layer, q, torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), None
        )
