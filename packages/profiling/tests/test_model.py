"""The Transformer LM against the reference, its part switches against each other, its errors."""

import pytest
import torch

from llmsys.profiling import SIZES, ModelConfig, TransformerLM, num_parameters, use_int8_linears
from llmsys.profiling.infra.accounting import forward_flops
from llmsys.profiling.model import TransformerBlock
from llmsys.profiling.optimizer import AdamW
from llmsys.profiling.reference import transformer_lm_reference
from llmsys.profiling.training import autocast, lm_loss, random_batch, step_loss

# Odd sizes on purpose: 13 tokens, 3 heads of width 8, d_ff 40.
TINY = ModelConfig(
    vocab_size=101, context_length=16, d_model=24, d_ff=40, num_layers=2, num_heads=3
)


def loss_and_grads(model, tokens, targets, dtype="fp32"):
    model.zero_grad(set_to_none=True)
    with autocast(dtype, "cpu"):
        loss = step_loss(model, model.config, tokens, targets)  # eager loss: lm_loss(logits)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def twin(model: TransformerLM, **changes) -> TransformerLM:
    """A model with other parts and the same weights."""
    other = TransformerLM(model.config.replace(**changes))
    other.load_state_dict(model.state_dict())
    return other


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_model_matches_the_reference_in_float64(attention):
    model = TransformerLM(TINY.replace(attention=attention), dtype=torch.float64)
    tokens = torch.randint(0, TINY.vocab_size, (2, 13))
    expected = transformer_lm_reference(model.state_dict(), tokens, model.config)
    torch.testing.assert_close(model(tokens), expected, rtol=1e-10, atol=1e-10)


def test_moe_variant_matches_the_reference_in_float64():
    config = TINY.replace(ffn="moe", num_experts=4, topk=2)
    model = TransformerLM(config, dtype=torch.float64)
    tokens = torch.randint(0, TINY.vocab_size, (2, 7))
    expected = transformer_lm_reference(model.state_dict(), tokens, config)
    # MoEFeedForward takes the routing softmax in float32 (then casts back): float32 error.
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-7)


def test_logits_depend_only_on_earlier_tokens():
    model = TransformerLM(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (1, 10))
    changed = tokens.clone()
    changed[0, 6] = (changed[0, 6] + 1) % TINY.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize(
    ("changes", "dtype", "tol"),
    [
        ({"attention": "naive"}, "fp32", 1e-5),
        ({"attention": "flash"}, "fp32", 1e-3),  # tf32-style dots under the interpreter
        ({"ffn": "swiglu"}, "fp32", 1e-5),
        ({"attention": "flash", "ffn": "swiglu"}, "bf16", 2e-2),
        ({"checkpoint": True}, "fp32", 1e-6),
        # llmsys.kernels_fused: on the float32 residual stream the same formulas as eager
        ({"norm": "fused", "checkpoint": True}, "fp32", 1e-5),  # (x, branch) through checkpoint
        ({"rope": "fused"}, "fp32", 1e-5),
        ({"loss": "fused"}, "fp32", 1e-5),
        (dict.fromkeys(("norm", "rope", "loss"), "fused"), "bf16", 2e-2),
    ],
)
def test_each_part_switch_gives_the_same_loss_and_gradients(changes, dtype, tol):
    base = TransformerLM(TINY)  # sdpa attention, eager SwiGLU
    tokens, targets = random_batch(TINY, 2, 13, "cpu")
    loss, grads = loss_and_grads(base, tokens, targets, dtype)
    other_loss, other_grads = loss_and_grads(twin(base, **changes), tokens, targets, dtype)
    torch.testing.assert_close(other_loss, loss, rtol=tol, atol=tol)
    for name, grad in grads.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(other_grads[name], grad, rtol=tol, atol=tol * scale)


def test_default_parts_run_the_eager_model_as_before():
    """The defaults keep today's model: no kernels_fused part, the unfused block, and the loss
    of ``model(tokens, targets)`` bit for bit ``lm_loss`` of the logits."""
    config = ModelConfig()
    assert (config.norm, config.rope, config.loss) == ("eager", "eager", "eager")
    model = TransformerLM(TINY)
    assert all(type(block) is TransformerBlock for block in model.blocks)
    norms = [m for m in model.modules() if type(m).__name__ == "RMSNorm"]
    assert len(norms) == 2 * TINY.num_layers + 1 and all(n.kernel is None for n in norms)
    assert model.blocks[0].attn.rope.kernel is None and model.loss_kernel is None
    tokens, targets = random_batch(TINY, 2, 13, "cpu")
    with torch.no_grad():
        x = model.embedding(tokens)
        for block in model.blocks:  # x + attn(norm(x)); x + ffn(norm(x)), as written before
            x = x + block.attn(block.attn_norm(x))
            x = x + block.ffn(block.ffn_norm(x))
        expected = model.lm_head(model.final_norm(x))
        assert torch.equal(model(tokens), expected)
        assert torch.equal(model(tokens, targets), lm_loss(expected, targets))


def test_fused_parts_keep_the_logits():
    """norm and rope fused: float32 logits within float32 rounding; a fused loss leaves
    ``model(tokens)``'s logits as they are (the kernel runs only with targets)."""
    base = TransformerLM(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (2, 13))
    with torch.no_grad():
        expected = base(tokens)
        fused = twin(base, norm="fused", rope="fused")(tokens)
        torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(twin(base, loss="fused")(tokens), expected)


def test_fused_norm_in_a_bfloat16_model_is_one_rounding_from_eager():
    """On a bfloat16 stream the kernel rounds x / rms(x) to bfloat16 before the weight multiplies
    it (Hugging Face's order) where eager multiplies in float32: outputs a bf16 rounding apart."""
    base = TransformerLM(TINY, dtype=torch.bfloat16)
    with torch.no_grad():
        for norm in base.modules():
            if type(norm).__name__ == "RMSNorm":
                norm.weight.uniform_(0.5, 1.5)  # not all ones, so the order matters
    tokens = torch.randint(0, TINY.vocab_size, (2, 13))
    fused = TransformerLM(TINY.replace(norm="fused"), dtype=torch.bfloat16)
    fused.load_state_dict(base.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), base(tokens), rtol=2e-2, atol=2e-2)


def test_fused_parts_compile_into_one_graph():
    config = TINY.replace(num_layers=1, **dict.fromkeys(("norm", "rope", "loss"), "fused"))
    model = TransformerLM(config)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    tokens, targets = random_batch(config, 2, 5, "cpu")
    torch.testing.assert_close(compiled(tokens, targets), model(tokens, targets))


def test_int8_linears_keep_the_loss_within_int8_error():
    model = TransformerLM(TINY).to(torch.bfloat16)
    tokens, targets = random_batch(TINY, 2, 13, "cpu")
    with torch.no_grad():
        expected = lm_loss(model(tokens), targets)
        use_int8_linears(model)
        got = lm_loss(model(tokens), targets)
    assert type(model.blocks[0].attn.qkv_proj).__name__ == "Int8Linear"
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=0)


def test_named_sizes_have_the_parameter_counts_of_their_shapes():
    for size, (d, d_ff, layers, _) in SIZES.items():
        with torch.device("meta"):
            model = TransformerLM(ModelConfig.named(size))
        per_layer = 4 * d * d + 3 * d * d_ff + 2 * d  # attention, SwiGLU, two norms
        assert num_parameters(model) == layers * per_layer + 2 * 10000 * d + d
        assert num_parameters(model, embedding=False) == num_parameters(model) - 10000 * d
    with torch.device("meta"):
        xl = TransformerLM(ModelConfig.named("xl"))
    assert 1.95e9 < num_parameters(xl) < 2.05e9  # "about 2.0B with SwiGLU"


def test_forward_flops_match_pytorchs_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    model = TransformerLM(TINY.replace(attention="naive"))
    tokens = torch.randint(0, TINY.vocab_size, (2, 13))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens)
    # The counter sees the full (T x T) score matmuls; the accounting counts the causal half.
    b, t, c = 2, 13, TINY
    full_minus_causal = c.num_layers * 4 * b * c.num_heads * c.head_dim * (t * t - t * (t + 1) / 2)
    assert counter.get_total_flops() == forward_flops(TINY, b, t) + full_minus_causal


def test_readable_adamw_matches_torch():
    # float64, so the two update formulas' rounding (sqrt(v / bc2) vs sqrt(v) / sqrt(bc2))
    # stays far below the tolerance through three steps.
    ours, theirs = (
        TransformerLM(TINY, dtype=torch.float64),
        TransformerLM(TINY, dtype=torch.float64),
    )
    theirs.load_state_dict(ours.state_dict())
    options = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    opt_ours = AdamW(ours.parameters(), **options)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), foreach=False, **options)
    for _ in range(3):
        tokens, targets = random_batch(TINY, 2, 9, "cpu")
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            lm_loss(model(tokens), targets).backward()
            opt.step()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"num_heads": 5}, "must divide"),
        ({"d_model": 30, "num_heads": 10}, "even for RoPE"),
        ({"attention": "flash2"}, "`attention` must be one of"),
        ({"ffn": "gelu"}, "`ffn` must be one of"),
        ({"num_layers": 0}, "`num_layers` must be a positive int"),
        ({"ffn": "moe", "topk": 9, "num_experts": 8}, "`topk`"),
        ({"norm": "triton"}, r"`norm` must be one of \('eager', 'fused'\), got 'triton'"),
        ({"rope": "Fused"}, r"`rope` must be one of \('eager', 'fused'\), got 'Fused'"),
        ({"loss": None}, r"`loss` must be one of \('eager', 'fused'\), got None"),
    ],
)
def test_bad_configs_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        TINY.replace(**changes)


def test_bad_inputs_are_refused_by_name():
    model = TransformerLM(TINY)
    with pytest.raises(TypeError, match=r"must be an int32/int64 tensor, got torch\.float"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"seq <= context_length=16, got \(1, 17\)"):
        model(torch.zeros(1, 17, dtype=torch.long))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(TypeError, match=r"`targets` must be an int64 tensor, got torch\.int32"):
        model(tokens, tokens.int())
    with pytest.raises(ValueError, match=r"`targets` must have the shape of `tokens` \(1, 4\)"):
        model(tokens, tokens[:, :3])
    with pytest.raises(ValueError, match=r"`model` must have config\.loss='eager'"):
        use_int8_linears(TransformerLM(TINY.replace(loss="fused")))
    with pytest.raises(TypeError, match="`config` must be a ModelConfig"):
        TransformerLM({"d_model": 8})
    with pytest.raises(ValueError, match="`size` must be one of"):
        ModelConfig.named("huge")
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        autocast("fp16", "cpu")
