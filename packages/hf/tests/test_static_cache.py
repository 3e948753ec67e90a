"""A static KV cache served by the rewritten attention (issue 46): after ``apply_llmsys`` and
``quantize_model`` every forward over a ``StaticCache`` that is plain causal attention reads the
cache through flash-attn2 (``decode_attention`` in place for up to 16 new tokens,
``flash_attention`` for a longer prompt), whatever transformers version is installed, and gives
the SDPA path's tokens and logits; what it cannot serve goes to SDPA (``llmsys_serve``) or is
refused by name (``llmsys_fa2``)."""

import contextlib
from unittest import mock

import pytest
import torch
from cache_routes import logits_over_a_static_cache, routes, served_and_sdpa
from hf_models import build

from llmsys.hf import apply_llmsys, cached_forward, forwards, generate, quantize_model
from llmsys.hf import attention as hf_attention
from llmsys.hf.generation import sliding_layers
from llmsys_dev.compare import relative_error

transformers = pytest.importorskip("transformers")

# float32 on the CPU; CUDA float32 runs TF32 dots (10-bit mantissa)
TOL = {"cpu": 1e-4, "cuda": 1e-2}
NEW = 3  # greedy tokens per sequence


@pytest.mark.parametrize(
    ("rewrite", "config"),
    [
        ("apply_llmsys", {}),  # 2 query heads per kv head
        ("quantize_model", {"num_key_value_heads": 1}),  # 4 query heads per kv head
    ],
    ids=["apply_llmsys-gqa2", "quantize_model-gqa4"],
)
def test_generate_reads_the_static_cache_through_flash_attn2_as_sdpa_would(rewrite, config, device):
    prompt = 5
    served, reference = served_and_sdpa(rewrite, device, num_hidden_layers=1, **config)
    implementation = {"apply_llmsys": "llmsys_fa2", "quantize_model": "llmsys_serve"}[rewrite]
    assert served.config._attn_implementation == implementation
    ids = torch.randint(0, 97, (2, prompt), generator=torch.Generator().manual_seed(2))
    ids = ids.to(device)
    with routes() as seen:
        tokens = generate(served, ids, NEW)  # (2, prompt + NEW)
    assert seen["sdpa"] == 0 and seen["flash"] == []
    assert len(seen["decode"]) == NEW  # the prompt, then one step per token after the first

    # The logits of those tokens, a one-token step and a two-token step (speculative or
    # chunked decoding) after the prompt, against SDPA's over the same static cache.
    segments = [(0, prompt), (prompt, prompt + 1), (prompt + 1, prompt + NEW)]
    with routes() as seen:
        got, cache = logits_over_a_static_cache(served, tokens, segments)
    want, _ = logits_over_a_static_cache(reference, tokens, segments)
    tol = TOL[torch.device(device).type]
    assert relative_error(got, want) < tol
    # each token generate chose is SDPA's best one, up to rounding (a near-tie may go either way)
    steps = want[:, prompt - 1 : -1]
    chosen = steps.gather(-1, tokens[:, prompt:, None]).squeeze(-1)
    assert (steps.max(-1).values - chosen <= tol * steps.abs().amax()).all()

    # every step of up to 16 tokens read the cache's own tensors in place, each sequence's
    # length counting the new tokens
    layer = cache.layers[0]
    buffers = (layer.keys.data_ptr(), layer.values.data_ptr())
    on_cpu = torch.device(device).type == "cpu"
    assert seen["decode"] == [
        (end - start, *buffers, [end] * 2 if on_cpu else None) for start, end in segments
    ]


@contextlib.contextmanager
def fused_appends(enabled: bool = True):
    """Counts the ``rotary_into_cache`` calls of llmsys.hf's attention forward (the fused
    rotary and cache append); with ``enabled=False`` no forward takes that route (every one
    rotates, then calls ``cache.update``)."""
    calls = []
    fused = forwards.rotary_into_cache

    def spy(*args):
        calls.append(args[1].shape[2])  # new tokens
        return fused(*args)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(forwards, "rotary_into_cache", spy))
        if not enabled:
            off = mock.patch.object(forwards, "appendable_static_layer", lambda *args: None)
            stack.enter_context(off)
        yield calls


@pytest.mark.parametrize(
    ("rewrite", "config"),
    [("apply_llmsys", {}), ("quantize_model", {"num_key_value_heads": 1})],
    ids=["apply_llmsys-gqa2", "quantize_model-gqa4"],
)
def test_fused_rotary_and_append_write_the_unfused_cache(rewrite, config, device):
    """A decode step over transformers' StaticLayer rotates and appends in one launch
    (``rotary_into_cache``), once per layer and step: ``generate`` gives the tokens of rotary
    then ``cache.update``, and the cache and its lengths after a prompt, a one-token and a
    two-token step are the same to the bit."""
    served, _ = served_and_sdpa(rewrite, device, num_hidden_layers=1, **config)
    layers = len(served.model.layers)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(6)).to(device)
    with fused_appends() as calls:
        tokens = generate(served, ids, NEW)
    # the prompt allocates each layer's cache through cache.update; then NEW - 1 steps of 1
    assert calls == [1] * (NEW - 1) * layers
    with fused_appends(enabled=False) as calls:
        assert torch.equal(generate(served, ids, NEW), tokens)
    assert calls == []

    segments = [(0, 5), (5, 6), (6, 8)]
    with fused_appends() as calls:
        fused_logits, fused_cache = logits_over_a_static_cache(served, tokens, segments)
    assert calls == [1] * layers + [2] * layers
    with fused_appends(enabled=False):
        logits, cache = logits_over_a_static_cache(served, tokens, segments)
    torch.testing.assert_close(fused_logits, logits, rtol=0, atol=0)
    for fused_layer, layer in zip(fused_cache.layers, cache.layers, strict=True):
        assert torch.equal(fused_layer.keys, layer.keys)
        assert torch.equal(fused_layer.values, layer.values)
        assert torch.equal(fused_layer.cumulative_length, layer.cumulative_length)
    assert cache.layers[0].cumulative_length.item() == 8


def test_what_the_fused_append_does_not_fit_goes_through_cache_update(device):
    """No ``rotary_into_cache`` where its append is not what ``cache.update`` does or its rotary
    not the model's: a sliding-window layer (whose ``update`` also counts on the host) and a
    partial rotary read the cache through ``decode_attention`` after ``cache.update``; a
    forward that wants gradients goes that way too, to ``decode_attention``'s refusal."""
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(7)).to(device)
    # the prompt, then two steps; a slot left (a step into a sliding-window layer's last slot is
    # attention over the whole sequence so far, not the verdict)
    segments = [(0, 5), (5, 6), (6, 7)]
    fa2 = hf_attention.register_flash_attention()
    window = rotary_only(fa2, device, family="mistral", sliding_window=32)
    window.config.partial_rotary_factor = 1.0  # full-width again: only the layer is unfit
    partial = rotary_only(fa2, device)
    for model, layer_type in ((window, "StaticSlidingWindowLayer"), (partial, "StaticLayer")):
        with fused_appends() as calls, routes() as seen:
            _, cache = logits_over_a_static_cache(model, ids, segments)
        assert type(cache.layers[0]).__name__ == layer_type
        assert calls == [] and [n for n, *_ in seen["decode"]] == [5, 1, 1]

    partial.config.partial_rotary_factor = 1.0  # fit but for the gradient
    cache = transformers.StaticCache(config=partial.config, max_cache_len=7)
    call = cached_forward(partial, cache)
    with torch.no_grad():
        call(ids[:, :5], torch.arange(5, device=device).expand(2, -1))
    with fused_appends() as calls, pytest.raises(RuntimeError, match="inference-only"):
        call(ids[:, 5:6], torch.full((2, 1), 5, device=device))
    assert calls == []


def rotary_only(implementation: str, device, family: str = "llama", **config):
    """A one-layer model whose attention forward alone is llmsys' (``apply_llmsys``' rotary
    part), on ``implementation``: the attention's routes with no kernel to interpret but the
    attention's. Set after the model is built, a partial rotary factor leaves the rotary
    embeddings full-width, but q and k rotate through transformers' ``apply_rotary_pos_emb``."""
    model = build(family, num_hidden_layers=1, **config).to(device).eval()
    apply_llmsys(model, attention=False, mlp=False, rms_norm=False, loss=False)
    model.config.partial_rotary_factor = 0.5
    model.set_attn_implementation(implementation)
    return model


def test_a_prompt_over_16_tokens_fills_the_cache_through_flash_attention(device):
    """A prompt of 17 tokens into an empty static cache: causal ``flash_attention`` on its own
    keys and values (written to the cache as transformers does), then a decode step over them."""
    fa2 = rotary_only(hf_attention.register_flash_attention(), device)
    sdpa = rotary_only("sdpa", device)
    ids = torch.randint(0, 97, (2, 18), generator=torch.Generator().manual_seed(5)).to(device)
    segments = [(0, 17), (17, 18)]
    with routes() as seen:
        got, cache = logits_over_a_static_cache(fa2, ids, segments)
    layer = cache.layers[0]
    lengths = [18, 18] if torch.device(device).type == "cpu" else None
    assert seen["flash"] == [(17, 17, True)] and seen["sdpa"] == 0
    assert seen["decode"] == [(1, layer.keys.data_ptr(), layer.values.data_ptr(), lengths)]
    want, reference = logits_over_a_static_cache(sdpa, ids, segments)
    assert relative_error(got, want) < TOL[torch.device(device).type]
    torch.testing.assert_close(layer.keys, reference.layers[0].keys)  # the cache transformers'


def test_what_the_decode_kernel_cannot_serve_goes_to_sdpa_or_is_refused(device):
    """Padding, more than 16 new tokens over a non-empty cache, and a sliding window shorter
    than the cache: ``llmsys_serve`` (``quantize_model``'s) gives SDPA's result through SDPA,
    ``llmsys_fa2`` (``apply_llmsys``') refuses each by name."""
    serve = rotary_only(hf_attention.register_serving_attention(), device)
    fa2 = rotary_only(hf_attention.register_flash_attention(), device)
    sdpa = rotary_only("sdpa", device)
    ids = torch.randint(0, 97, (2, 22), generator=torch.Generator().manual_seed(3)).to(device)

    mask = torch.ones_like(ids[:, :6])
    mask[1, :2] = 0  # the second sequence left-padded by two tokens
    options = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    options |= dict(attention_mask=mask, cache_implementation="static")  # transformers' generate
    with torch.no_grad():
        with routes() as seen:
            got = serve.generate(ids[:, :6], **options)
        assert seen["decode"] == [] and seen["sdpa"] > 0
        assert torch.equal(got, sdpa.generate(ids[:, :6], **options))
        with pytest.raises(ValueError, match="'llmsys_fa2': attention_mask has padded positions"):
            fa2.generate(ids[:, :6], **options)

    chunked = [(0, 5), (5, 22)]  # 17 new tokens over 5 cached ones
    with routes() as seen:
        got, _ = logits_over_a_static_cache(serve, ids, chunked)
    assert len(seen["decode"]) == 1 and seen["sdpa"] == 1  # the prompt, then SDPA
    want, _ = logits_over_a_static_cache(sdpa, ids, chunked)
    assert relative_error(got, want) < TOL[torch.device(device).type]
    with pytest.raises(ValueError, match="17 new tokens over 5 cached ones in a static KV cache"):
        logits_over_a_static_cache(fa2, ids, chunked)

    window = dict(family="mistral", sliding_window=4)  # a cache of 8 tokens rolls past 4
    serve, sdpa = (rotary_only(name, device, **window) for name in ("llmsys_serve", "sdpa"))
    with routes() as seen:
        got = generate(serve, ids[:, :5], 3)  # eagerly, on CUDA too: a graph cannot replay it
    assert seen["decode"] == [] and torch.equal(got, generate(sdpa, ids[:, :5], 3))
    assert sliding_layers(transformers.StaticCache(config=serve.config, max_cache_len=8)) == [0]
    if ids.is_cuda:
        with pytest.raises(ValueError, match=r"layers \[0\] are sliding-window layers"):
            generate(serve, ids[:, :5], 3, cuda_graph=True)
    fa2 = rotary_only("llmsys_fa2", device, **window)
    with pytest.raises(ValueError, match="sliding window or attention chunk of 4 tokens"):
        generate(fa2, ids[:, :5], 3)


def test_transformers_own_attention_refuses_the_static_cache_by_name(device):
    """The verdict reaches a layer whose attention forward is transformers' (the rotary part left
    out, a stock model set to llmsys_serve): refused, not computed without the lengths. So
    ``quantize_model`` keeps SDPA for a model with a layer it could not rewrite."""
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4)).to(device)
    no_rotary = build("llama", num_hidden_layers=1).to(device).eval()
    apply_llmsys(no_rotary, mlp=False, rms_norm=False, rotary=False, loss=False)
    stock = build("llama", num_hidden_layers=1).to(device).eval()
    stock.set_attn_implementation(hf_attention.register_serving_attention())
    for model, name in ((no_rotary, "llmsys_fa2"), (stock, "llmsys_serve")):
        with pytest.raises(ValueError, match=f"'{name}': a static KV cache .* runs transformers'"):
            generate(model, ids, 2)

    mixed = build("llama", num_hidden_layers=2)
    mixed.model.layers[1].mlp.act_fn = torch.nn.GELU()  # not SiLU: that layer is not rewritten
    with pytest.warns(UserWarning, match=r"model\.layers\.1"):
        quantize_model(mixed)
    assert mixed.config._attn_implementation == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rewrite", ["apply_llmsys", "quantize_model"])
def test_gpu_cuda_graph_steps_read_the_cache_through_decode_attention(rewrite):
    """float16 on the GPU: the CUDA-graph replay generates the eager steps' tokens, every step
    through ``decode_attention`` on the cache in place (no SDPA, so no ``repeat_kv`` copy of the
    cache to every query head), and the logits are SDPA's up to float16 rounding."""
    served, reference = served_and_sdpa(rewrite, "cuda", dtype=torch.float16)
    ids = torch.randint(0, 97, (4, 7), generator=torch.Generator().manual_seed(5)).cuda()
    with routes() as seen:
        eager = generate(served, ids, 12, cuda_graph=False)
    assert seen["sdpa"] == 0 and len(seen["decode"]) == 12 * len(served.model.layers)
    with routes() as seen:
        graphed = generate(served, ids, 12, cuda_graph=True)
    assert torch.equal(graphed, eager)
    # the prefill, the eager first step and the captured one: replays run no Python
    assert seen["sdpa"] == 0 and len(seen["decode"]) == 3 * len(served.model.layers)

    segments = [(0, 7)] + [(t, t + 1) for t in range(7, 18)]
    got, _ = logits_over_a_static_cache(served, eager, segments)
    want, _ = logits_over_a_static_cache(reference, eager, segments)
    assert relative_error(got, want) < 1e-2
