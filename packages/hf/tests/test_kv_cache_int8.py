"""The int8 KV cache in serving (issue 46): ``Int8StaticCache`` stores keys and values as int8
with one float32 scale per (sequence, kv head, token), llmsys' attention forwards quantize into
it (``append_kv_int8``) and read it through ``decode_attention`` with the scales, and
``generate(..., kv_cache="int8")`` serves from it. Checked against the float cache's logits and
tokens, and its contents against ``quantize_kv_int8_reference`` of the float cache's."""

import pytest
import torch
from cache_routes import logits_over_a_static_cache, routes, served_and_sdpa
from hf_models import build

from llmsys.flash_attn2 import quantize_kv_int8_reference
from llmsys.hf import apply_llmsys, cached_forward, generate
from llmsys_dev.compare import relative_error

transformers = pytest.importorskip("transformers")
kv_cache = pytest.importorskip("llmsys.hf.kv_cache")

# The int8 cache's logits against the float cache's (relative error): one quantization step
# per key and value is 1/254 of the row's largest value; measured 1.8e-3 on the tiny models.
TOL = 2e-2
REWRITES = [("apply_llmsys", {}), ("quantize_model", {"num_key_value_heads": 1})]
IDS = ["apply_llmsys-gqa2", "quantize_model-gqa4"]


def random_ids(seed, shape, device):
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize(("rewrite", "config"), REWRITES, ids=IDS)
def test_int8_cache_logits_and_contents_follow_the_float_cache(rewrite, config, device):
    """A prompt, a one-token and a two-token step over the int8 cache: the logits are the float
    cache's within the quantization error, every forward reads the int8 layer's own tensors and
    scales through ``decode_attention``, and the cache holds ``quantize_kv_int8_reference`` of
    the float cache's keys and values (layer 0 to the bit: its keys and values are the same
    floats; the next layer's inputs carry the first's quantization error)."""
    served, _ = served_and_sdpa(rewrite, device, **config)  # 2 layers
    tokens = random_ids(11, (2, 8), device)
    segments = [(0, 5), (5, 6), (6, 8)]
    with routes() as seen:
        got, cache = logits_over_a_static_cache(served, tokens, segments, kv_cache.Int8StaticCache)
    want, float_cache = logits_over_a_static_cache(served, tokens, segments)
    error = relative_error(got, want)
    print(f"int8 KV cache ({rewrite}): logits' relative error {error:.2e}")
    assert error < TOL

    layers = cache.layers
    assert all(type(layer) is kv_cache.Int8StaticLayer for layer in layers)
    on_cpu = torch.device(device).type == "cpu"
    assert seen["sdpa"] == 0 and seen["flash"] == []
    assert seen["decode"] == [
        (end - start, layer.keys.data_ptr(), layer.values.data_ptr(), [end] * 2 if on_cpu else None)
        for start, end in segments
        for layer in layers
    ]
    assert seen["scales"] == [
        (layer.k_scale.data_ptr(), layer.v_scale.data_ptr()) for _ in segments for layer in layers
    ]

    for i, (layer, reference) in enumerate(zip(layers, float_cache.layers, strict=True)):
        assert layer.cumulative_length.item() == 8
        assert layer.keys.dtype == torch.int8 and layer.k_scale.dtype == torch.float32
        for stored, scale, floats in (
            (layer.keys, layer.k_scale, reference.keys),
            (layer.values, layer.v_scale, reference.values),
        ):
            q, s = quantize_kv_int8_reference(floats)  # the unfilled rows: zeros, scale 0
            if i == 0:
                assert torch.equal(stored, q) and torch.equal(scale, s)
            else:
                rebuilt = stored.float() * scale[..., None]
                assert relative_error(rebuilt, floats) < TOL
                assert (scale[:, :, 8:] == 0).all()


@pytest.mark.parametrize(("rewrite", "config"), REWRITES, ids=IDS)
def test_generate_with_the_int8_cache_chooses_the_float_caches_best_tokens(rewrite, config, device):
    """``generate(..., kv_cache="int8")``: the prompt through ``decode_attention`` (5 tokens),
    then one step per token, every one over the int8 layers; each token it chose is the best or
    within the quantization error of the best under the float cache's logits (a near-tie may
    go either way, so equal tokens are not asserted; the share is printed)."""
    served, _ = served_and_sdpa(rewrite, device, num_hidden_layers=1, **config)
    ids = random_ids(12, (2, 5), device)
    new = 4
    with routes() as seen:
        tokens = generate(served, ids, new, kv_cache="int8")
    assert tokens.shape == (2, 5 + new) and torch.equal(tokens[:, :5], ids)
    assert seen["sdpa"] == 0 and seen["flash"] == [] and len(seen["decode"]) == new
    assert None not in seen["scales"]  # every step read an int8 cache

    segments = [(0, 5)] + [(t, t + 1) for t in range(5, 5 + new - 1)]
    want, _ = logits_over_a_static_cache(served, tokens, segments)  # the float cache's
    steps = want[:, 4:]
    chosen = steps.gather(-1, tokens[:, 5:, None]).squeeze(-1)
    assert (steps.max(-1).values - chosen <= TOL * steps.abs().amax()).all()
    same = (tokens == generate(served, ids, new)).float().mean().item()
    print(f"int8 KV cache ({rewrite}): {same:.0%} of generate's tokens are the float cache's")


def test_a_prompt_over_16_tokens_fills_the_int8_cache_through_flash_attention(device):
    """17 prompt tokens into an empty int8 cache: causal ``flash_attention`` on the new float
    keys and values, the append, then a decode step over the int8 cache."""
    served, _ = served_and_sdpa("apply_llmsys", device, num_hidden_layers=1)
    tokens = random_ids(13, (2, 18), device)
    segments = [(0, 17), (17, 18)]
    with routes() as seen:
        got, cache = logits_over_a_static_cache(served, tokens, segments, kv_cache.Int8StaticCache)
    layer = cache.layers[0]
    assert seen["flash"] == [(17, 17, True)] and seen["sdpa"] == 0
    lengths = [18, 18] if torch.device(device).type == "cpu" else None
    assert seen["decode"] == [(1, layer.keys.data_ptr(), layer.values.data_ptr(), lengths)]
    want, float_cache = logits_over_a_static_cache(served, tokens, segments)
    assert relative_error(got, want) < TOL
    q, s = quantize_kv_int8_reference(float_cache.layers[0].keys)
    assert torch.equal(layer.keys, q) and torch.equal(layer.k_scale, s)


def test_transformers_own_attention_refuses_the_int8_cache(device):
    """A stock model (SDPA) handed an ``Int8StaticCache`` calls the layer's ``update``, which
    refuses by name before writing anything; ``generate(kv_cache="int8")`` refuses a model
    whose attention is not llmsys' before anything runs."""
    stock = build("llama", num_hidden_layers=1).to(device).eval()
    ids = random_ids(14, (2, 5), device)
    cache = kv_cache.Int8StaticCache(config=stock.config, max_cache_len=8)
    call = cached_forward(stock, cache)
    with torch.no_grad(), pytest.raises(ValueError, match=r"Int8StaticLayer\.update: the int8 KV"):
        call(ids, torch.arange(5, device=device).expand(2, -1))
    assert not cache.layers[0].is_initialized and cache.layers[0].cumulative_length.item() == 0

    no_rotary = build("llama", num_hidden_layers=1).to(device).eval()
    apply_llmsys(no_rotary, mlp=False, rms_norm=False, rotary=False, loss=False)
    rotary_on_sdpa = build("llama", num_hidden_layers=1).to(device).eval()
    apply_llmsys(rotary_on_sdpa, attention=False, mlp=False, rms_norm=False, loss=False)
    refused = [
        (stock, "1 of its 1 attention modules run transformers' forward"),
        (no_rotary, "1 of its 1 attention modules run transformers' forward"),
        (rotary_on_sdpa, "its attn_implementation is 'sdpa'"),
    ]
    for model, why in refused:
        with routes() as seen, pytest.raises(ValueError, match=f"`kv_cache='int8'` .*{why}"):
            generate(model, ids, 2, kv_cache="int8")
        assert seen == {"decode": [], "scales": [], "flash": [], "sdpa": 0}  # nothing ran


def test_what_the_int8_cache_cannot_serve_is_refused_before_it_is_written(device):
    """More than 16 new tokens over a non-empty int8 cache: ``llmsys_serve`` would hand it to
    SDPA, which cannot read int8 keys, so the forward refuses it (the cache keeps its length);
    ``llmsys_fa2``'s mask function refuses it as over a float cache."""
    ids = random_ids(15, (2, 22), device)
    chunked = [(0, 5), (5, 22)]
    serve, _ = served_and_sdpa("quantize_model", device, num_hidden_layers=1)
    assert serve.config._attn_implementation == "llmsys_serve"
    cache = kv_cache.Int8StaticCache(config=serve.config, max_cache_len=22)
    call = cached_forward(serve, cache)
    with torch.no_grad():
        call(ids[:, :5], torch.arange(5, device=device).expand(2, -1))
        with pytest.raises(ValueError, match=r"int8 KV cache .* read only as plain causal"):
            call(ids[:, 5:], torch.arange(5, 22, device=device).expand(2, -1))
    assert cache.layers[0].cumulative_length.item() == 5
    fa2, _ = served_and_sdpa("apply_llmsys", device, num_hidden_layers=1)
    with pytest.raises(ValueError, match="17 new tokens over 5 cached ones"):
        logits_over_a_static_cache(fa2, ids, chunked, kv_cache.Int8StaticCache)


@pytest.mark.parametrize(
    ("kv", "error", "match"),
    [
        (8, TypeError, "`kv_cache` must be a str"),
        ("fp8", ValueError, "`kv_cache` must be 'float' or 'int8', got 'fp8'"),
        ("INT8", ValueError, "`kv_cache` must be 'float' or 'int8'"),
    ],
)
def test_generate_refuses_a_bad_kv_cache_argument_by_name(kv, error, match, device):
    served, _ = served_and_sdpa("apply_llmsys", device, num_hidden_layers=1)
    with routes() as seen, pytest.raises(error, match=match):
        generate(served, random_ids(16, (1, 3), device), 2, kv_cache=kv)
    assert seen["decode"] == [] and seen["sdpa"] == 0


def test_int8_static_cache_refuses_what_it_cannot_hold():
    """Sliding-window layers (which transformers' own layer rolls on the host), offloading and
    a bad length are refused by name; ``generate`` refuses such a model too."""
    llama = build("llama", num_hidden_layers=1).config
    with pytest.raises(TypeError, match="`max_cache_len` must be an int, got float"):
        kv_cache.Int8StaticCache(config=llama, max_cache_len=8.0)
    with pytest.raises(ValueError, match="`max_cache_len` must be >= 1, got 0"):
        kv_cache.Int8StaticCache(config=llama, max_cache_len=0)
    with pytest.raises(ValueError, match="`offloading` must be False"):
        kv_cache.Int8StaticCache(config=llama, max_cache_len=8, offloading=True)
    window = build("mistral", num_hidden_layers=1, sliding_window=4)
    apply_llmsys(window, mlp=False, rms_norm=False, loss=False)
    with pytest.raises(ValueError, match=r"full static layer .*StaticSlidingWindowLayer"):
        kv_cache.Int8StaticCache(config=window.config, max_cache_len=8)
    with pytest.raises(ValueError, match="full static layer"):
        generate(window, random_ids(17, (1, 5), "cpu"), 3, kv_cache="int8")


def test_reset_empties_the_int8_cache_in_place(device):
    served, _ = served_and_sdpa("apply_llmsys", device, num_hidden_layers=1)
    _, cache = logits_over_a_static_cache(
        served, random_ids(18, (2, 6), device), [(0, 6)], kv_cache.Int8StaticCache
    )
    layer = cache.layers[0]
    addresses = [t.data_ptr() for t in (layer.keys, layer.values, layer.k_scale, layer.v_scale)]
    cache.reset()
    tensors = (layer.keys, layer.values, layer.k_scale, layer.v_scale)
    assert [t.data_ptr() for t in tensors] == addresses
    assert all((t == 0).all() for t in tensors) and layer.cumulative_length.item() == 0
