"""apply_llmsys on tiny Llama, Mistral and Qwen2 models (random weights) against the same models
as transformers builds them: logits, loss and every gradient."""

import copy

import pytest
import torch
from hf_models import FAMILIES, TINY, batch, build
from torch import nn

from llmsys.hf import apply_llmsys, quantize_model
from llmsys.hf.rewrite import original_class


def unchanged(model: nn.Module) -> bool:
    """Whether every module of ``model`` still has its transformers class."""
    return all(type(m) is original_class(m) for m in model.modules())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match_transformers(family):
    stock = build(family)
    ours = copy.deepcopy(stock)
    report = apply_llmsys(ours)
    assert all(report[part] for part in ("attention", "mlp", "rms_norm", "rotary", "loss"))
    assert unchanged(stock)  # only `ours` changed
    tokens, labels = batch()

    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, stock(tokens).logits, atol=1e-5, rtol=1e-4)

    expected = stock(tokens, labels=labels)
    got = ours(tokens, labels=labels)
    assert got.logits is None  # the fused loss never built them
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-6, rtol=1e-5)
    got.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(ours.named_parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


def count_calls(monkeypatch, name: str) -> list:
    """Count the calls of kernels-fused function ``name`` from the forwards apply_llmsys binds
    (``llmsys.hf.forwards``)."""
    from llmsys.hf import forwards

    calls, function = [], getattr(forwards, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    monkeypatch.setattr(forwards, name, counted)
    return calls


@pytest.mark.parametrize("use_cache", [None, False], ids=["default", "no-cache"])
def test_every_fused_kernel_runs_whether_or_not_a_cache_is_made(monkeypatch, use_cache):
    """transformers makes a KV cache in every forward unless told not to: the fused rotary must
    run with it too (and update it), and so must the norms and the loss."""
    stock = build("llama")
    ours = copy.deepcopy(stock)
    apply_llmsys(ours)
    calls = {n: count_calls(monkeypatch, n) for n in ("rotary", "rms_norm", "causal_lm_loss")}
    tokens, labels = batch()
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    got = ours(tokens, labels=labels, **kwargs)
    assert {n: len(c) for n, c in calls.items()} == {
        "rotary": 2, "rms_norm": 5, "causal_lm_loss": 1
    }  # fmt: skip
    torch.testing.assert_close(got.loss, stock(tokens, labels=labels, **kwargs).loss)


def test_autocast_keeps_the_residual_stream_in_float32():
    """Under bf16 autocast over float32 weights the stream between layers stays float32, as in
    transformers' layer (float32 stream + bfloat16 attention output)."""
    stock = build("llama")
    ours = copy.deepcopy(stock)
    apply_llmsys(ours)
    tokens, _ = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = stock(tokens, output_hidden_states=True, use_cache=False)
        got = ours(tokens, output_hidden_states=True, use_cache=False)
    assert [h.dtype for h in got.hidden_states] == [h.dtype for h in expected.hidden_states]
    assert all(h.dtype == torch.float32 for h in got.hidden_states)
    torch.testing.assert_close(got.logits.float(), expected.logits.float(), atol=0.05, rtol=0.05)


def _saved_16bit_activations(model, tokens, labels) -> int:
    """Distinct bfloat16 (tokens, hidden) tensors autograd saves in one autocast forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = set()

    def pack(tensor):
        key = tensor.untyped_storage().data_ptr()
        activation = tensor.numel() == tokens.numel() * TINY["hidden_size"] and key not in params
        if (
            tensor.dtype == torch.bfloat16
            and tensor.shape[-1] == TINY["hidden_size"]
            and activation
        ):
            seen.add(key)
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        loss = model(tokens, labels=labels, use_cache=False).loss
    loss.backward()
    return len(seen)


def test_autocast_casts_each_norm_output_once_for_the_linears_after_it():
    """Stock autocast casts a norm's float32 output for q, k and v separately (and for gate and
    up), each linear saving its own copy; ours casts it once, so per layer three saved copies
    (q/k/v, o, gate/up) instead of six, with the loss and gradients still stock's."""
    stock = build("llama")
    ours = copy.deepcopy(stock)
    apply_llmsys(ours)
    tokens, labels = batch()
    layers = TINY["num_hidden_layers"]
    assert _saved_16bit_activations(stock, tokens, labels) == 6 * layers + 1  # + lm_head's input
    assert _saved_16bit_activations(ours, tokens, labels) == 3 * layers + 1  # + the loss's input
    for (name, want), got in zip(stock.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=2e-2, rtol=2e-2, msg=name)


def test_return_dict_false_gives_a_tuple_as_transformers_does():
    stock = build("llama")
    ours = copy.deepcopy(stock)
    apply_llmsys(ours)
    tokens, labels = batch()
    got = ours(tokens, labels=labels, return_dict=False)
    expected = stock(tokens, labels=labels, return_dict=False)
    assert isinstance(got, tuple)
    torch.testing.assert_close(got[0], expected[0])


def test_num_items_in_batch_and_ignore_index_follow_transformers():
    stock = build("llama")
    ours = copy.deepcopy(stock)
    apply_llmsys(ours)
    tokens, labels = batch()
    expected = stock(tokens, labels=labels, num_items_in_batch=torch.tensor(11)).loss
    got = ours(tokens, labels=labels, num_items_in_batch=torch.tensor(11)).loss
    torch.testing.assert_close(got, expected)
    labels = torch.where(tokens % 3 == 0, 5, tokens)  # token 5 stands for "ignore" here
    expected = stock(tokens, labels=labels, ignore_index=5).loss
    torch.testing.assert_close(ours(tokens, labels=labels, ignore_index=5).loss, expected)


def test_generation_with_a_cache_matches_transformers():
    stock = build("qwen2")
    ours = copy.deepcopy(stock)
    apply_llmsys(ours)
    tokens, _ = batch()
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(
        ours.generate(tokens[:1], **settings), stock.generate(tokens[:1], **settings)
    )


def test_a_second_call_replaces_nothing_and_parts_can_be_left_out():
    model = build("mistral")
    report = apply_llmsys(model, attention=False, loss=False)
    assert report["attention"] == [] and report["loss"] == []
    assert report["rms_norm"] == ["model.layers.0.input_layernorm",
                                  "model.layers.0.post_attention_layernorm",
                                  "model.layers.1.input_layernorm",
                                  "model.layers.1.post_attention_layernorm",
                                  "model.norm"]  # fmt: skip
    assert model.config._attn_implementation == "sdpa"
    with pytest.warns(UserWarning, match="nothing left to replace: `model` .* already rewritten"):
        again = apply_llmsys(model, attention=False, loss=False)
    assert not any(again.values())


def test_a_float64_model_is_refused_at_the_call_before_any_change():
    model = build("llama").double()
    with pytest.raises(TypeError, match=r"`model` must hold float16, bfloat16 or float32 .*"
                                        r"got torch\.float64"):  # fmt: skip
        apply_llmsys(model)
    assert unchanged(model)
    assert model.config._attn_implementation == "sdpa"
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_refusals_name_the_problem_and_change_nothing():
    with pytest.raises(TypeError, match=r"`model` must be an nn\.Module"):
        apply_llmsys("llama")
    with pytest.raises(TypeError, match=r"`loss` must be a bool"):
        apply_llmsys(build("llama"), loss=1)
    with pytest.raises(ValueError, match=r"decoder layers .* got none in Linear"):
        apply_llmsys(nn.Linear(3, 4))

    gelu = build("llama", hidden_act="gelu")
    before = {n: type(m) for n, m in gelu.named_modules()}
    with pytest.raises(ValueError, match="activation"):
        apply_llmsys(gelu)
    assert {n: type(m) for n, m in gelu.named_modules()} == before
    assert unchanged(gelu)

    base = build("llama").model  # LlamaModel: no head, so no loss to fuse
    with pytest.raises(ValueError, match="`loss` needs a causal-LM model"):
        apply_llmsys(base)
    assert apply_llmsys(base, loss=False)["rotary"]

    partial = build("llama")
    partial.config.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5"):
        apply_llmsys(partial)


def test_with_the_int8_serving_work_either_order_is_refused_clearly():
    """quantize_model rewrites transformers' own layers, apply_llmsys needs float ones: each
    after the other is refused with a ValueError that says why, before anything changes."""
    model = build("llama")
    apply_llmsys(model)
    with pytest.raises(ValueError, match=r"`model` must be transformers' float model, got one "
                                         r"rewritten by apply_llmsys"):  # fmt: skip
        quantize_model(model)
    assert not any(type(m).__name__ == "Int8Linear" for m in model.modules())

    quantized = build("llama")
    quantize_model(quantized)
    classes_before = [type(m) for m in quantized.modules()]
    with pytest.raises(ValueError, match=r"quantized already"):
        apply_llmsys(quantized)
    assert [type(m) for m in quantized.modules()] == classes_before
