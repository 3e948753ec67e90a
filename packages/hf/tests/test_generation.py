"""generate(): greedy tokens over a static cache, against transformers' own generate."""

import copy
import warnings

import pytest
import torch

from llmsys.hf import apply_llmsys, generate

transformers = pytest.importorskip("transformers")

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def build(family: str) -> torch.nn.Module:
    """A tiny model of ``family`` with random weights and SDPA attention."""
    config_class, model_class = FAMILIES[family]
    torch.manual_seed(0)
    config = config_class(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, attn_implementation="sdpa",
    )  # fmt: skip
    return model_class(config)


def prompt(batch: int = 3, length: int = 5) -> torch.Tensor:
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(2))


def greedy(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )


@pytest.mark.parametrize("new", [1, 2, 7])
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_match_transformers_generate(family, new):
    model = build(family).eval()
    ids = prompt()
    ours = generate(model, ids, new)
    assert ours.shape == (3, 5 + new) and ours.dtype == ids.dtype
    assert torch.equal(ours, greedy(model, ids, new))


def test_a_model_with_llmsys_kernels_generates_what_the_stock_model_does():
    """After apply_llmsys the static cache is read by flash-attn2's decode kernel (no
    set_attn_implementation("sdpa") first): the stock tokens (test_static_cache.py checks the
    route and the logits)."""
    stock = build("llama").eval()
    ours = copy.deepcopy(stock)
    apply_llmsys(ours)
    ids = prompt(2, 6)
    assert torch.equal(generate(ours, ids, 3), greedy(stock, ids, 3))


@pytest.mark.parametrize("rewritten", [False, True], ids=["stock", "apply_llmsys"])
def test_the_cache_is_passed_without_a_deprecated_keyword(rewritten):
    """transformers 5.2x deprecates ``past_key_values=`` (removed in 5.40); generate passes the
    cache under the keyword the model's class takes, also after apply_llmsys rebinds forward."""
    model = build("llama").eval()
    if rewritten:
        apply_llmsys(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(model, prompt(2, 4), 3)
    deprecations = [
        str(w.message)
        for w in caught
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
        and "past_key_values" in str(w.message)
    ]
    assert deprecations == []


def test_bad_arguments_are_named():
    model = build("llama").eval()
    ids = prompt()
    with pytest.raises(TypeError, match=r"`input_ids` must be a torch\.Tensor, got list"):
        generate(model, ids.tolist(), 2)
    with pytest.raises(ValueError, match=r"`input_ids` must be \(batch, prompt\).*got \(5,\)"):
        generate(model, ids[0], 2)
    with pytest.raises(ValueError, match=r"got \(3, 0\)"):
        generate(model, ids[:, :0], 2)
    with pytest.raises(TypeError, match=r"int64 or int32 token ids, got torch\.float32"):
        generate(model, ids.float(), 2)
    with pytest.raises(TypeError, match="`max_new_tokens` must be an int, got bool"):
        generate(model, ids, True)
    with pytest.raises(ValueError, match="`max_new_tokens` must be >= 1, got 0"):
        generate(model, ids, 0)
    with pytest.raises(ValueError, match="`cuda_graph=True` needs `input_ids` on a CUDA device"):
        generate(model, ids, 2, cuda_graph=True)
    before = ids.clone()
    generate(model, ids, 2)
    assert torch.equal(ids, before)  # the caller's prompt is not written


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (("model",), {}, TypeError, r"generate: `model` must be an nn.Module, got str"),
        ((None,), {}, TypeError, r"`model` must be an nn.Module, got NoneType"),
        ((torch.nn.Linear(2, 2),), {}, TypeError, r"`model` must be a causal LM with a `config`"),
        ((), {"cuda_graph": "no"}, TypeError, r"`cuda_graph` must be a bool or None, got str"),
        ((), {"cuda_graph": 0}, TypeError, r"`cuda_graph` must be a bool or None, got int"),
        ((), {"max_new_tokens": 2.0}, TypeError, r"`max_new_tokens` must be an int, got float"),
        ((), {"max_new_tokens": -3}, ValueError, r"`max_new_tokens` must be >= 1, got -3"),
        ((), {"input_ids": "ids"}, TypeError, r"`input_ids` must be a torch.Tensor, got str"),
        ((), {"input_ids": torch.ones(2, 3, 4, dtype=torch.long)}, ValueError, r"\(2, 3, 4\)"),
        ((), {"input_ids": torch.ones(2, 3, dtype=torch.uint8)}, TypeError, r"got torch.uint8"),
    ],
)
def test_every_argument_is_checked_by_name_before_anything_runs(args, kwargs, error, match):
    """Issue 49: a str model, or cuda_graph="no" (taken as True before), refused by name."""
    model = build("llama").eval()
    call = dict(model=model, input_ids=prompt(), max_new_tokens=2) | kwargs
    if args:
        call["model"] = args[0]
    with pytest.raises(error, match=match):
        generate(call.pop("model"), **call)


def test_cuda_graph_false_and_none_still_run_on_the_cpu():
    model = build("llama").eval()
    ids = prompt()
    assert torch.equal(generate(model, ids, 3, cuda_graph=False), generate(model, ids, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", ["stock", "llmsys"])
def test_cuda_graph_replay_generates_what_eager_steps_do(kernels):
    model = build("llama").half().cuda().eval()
    if kernels == "llmsys":
        apply_llmsys(model)  # the static cache read by flash-attn2's decode kernel
    ids = prompt(4, 7).cuda()
    eager = generate(model, ids, 12, cuda_graph=False)
    assert torch.equal(generate(model, ids, 12, cuda_graph=True), eager)
    assert torch.equal(eager, greedy(model, ids, 12))
