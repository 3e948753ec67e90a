"""Rotary embeddings on the GPU: Llama shapes in bfloat16 against eager, rounding, torch.compile
(inductor, fullgraph, reduce-overhead), CUDA graph replay, more than 2**31 elements."""

import pytest
import torch

from llmsys.kernels_fused import (
    apply_rotary_pos_emb,
    rotary,
    rotary_backward_reference,
    rotary_reference,
)
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu

# (B, Hq, Hk, S, D): Llama-3-8B and a D = 64 model at training length, decode (S = 1), odd sizes
# and the largest head_dim.
LLAMA_SHAPES = [(4, 32, 8, 2048, 128), (4, 16, 4, 2048, 64)]
SHAPES = [*LLAMA_SHAPES, (8, 32, 8, 1, 128), (3, 6, 2, 33, 6), (2, 8, 2, 67, 256), (1, 5, 5, 7, 4)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# A floor for ties only, far below an ulp of the outputs.
FLOOR = {torch.float32: 1e-7, torch.bfloat16: 2**-12, torch.float16: 2**-16}


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def make_inputs(shape, dtype, cos_dtype=None):
    """q and k laid out as Hugging Face makes them, cos and sin as Llama's rotary module does."""
    batch, n_q, n_k, seq_len, head_dim = shape
    q = torch.randn(batch, seq_len, n_q * head_dim, device="cuda").to(dtype)
    k = torch.randn(batch, seq_len, n_k * head_dim, device="cuda").to(dtype)
    q = q.view(batch, seq_len, n_q, head_dim).transpose(1, 2)
    k = k.view(batch, seq_len, n_k, head_dim).transpose(1, 2)
    inv_freq = 500000.0 ** -(torch.arange(0, head_dim, 2, device="cuda").double() / head_dim)
    start = torch.randint(0, 8192, (batch, 1), device="cuda").double()
    freqs = (start + torch.arange(seq_len, device="cuda"))[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_dtype = cos_dtype or dtype
    return q, k, emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)


def max_error(actual, expected) -> float:
    return max(
        (a.double() - e).abs().max().item() if a.numel() else 0.0
        for a, e in zip(actual, expected, strict=True)
    )


def grads(fn, q, k, cos, sin, grad_q_out, grad_k_out):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    return torch.autograd.grad(fn(q, k, cos, sin), (q, k), (grad_q_out, grad_k_out))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_forward_and_backward_within_twice_eager_error(shape, dtype):
    q, k, cos, sin = make_inputs(shape, dtype)
    exact = rotary_reference(q.double(), k.double(), cos.double(), sin.double())
    ours, eager = rotary(q, k, cos, sin), rotary_reference(q, k, cos, sin)
    ours_error, eager_error = max_error(ours, exact), max_error(eager, exact)
    print(f"forward  max error: ours {ours_error:.3g}, eager {eager_error:.3g}")
    assert ours_error <= 2 * eager_error + FLOOR[dtype]

    grad_q_out = torch.randn(q.shape, device="cuda").to(dtype)
    grad_k_out = torch.randn(k.shape, device="cuda").to(dtype)
    ours = grads(rotary, q, k, cos, sin, grad_q_out, grad_k_out)
    eager = grads(rotary_reference, q, k, cos, sin, grad_q_out, grad_k_out)
    exact = grads(
        rotary_reference,
        *(t.double() for t in (q, k, cos, sin, grad_q_out, grad_k_out)),
    )
    ours_error, eager_error = max_error(ours, exact), max_error(eager, exact)
    print(f"backward max error: ours {ours_error:.3g}, eager {eager_error:.3g}")
    assert ours_error <= 2 * eager_error + FLOOR[dtype]


@pytest.mark.parametrize("shape", LLAMA_SHAPES, ids=shape_id)
@pytest.mark.parametrize("cos_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bf16_rounds_the_float32_result_once(shape, cos_dtype):
    # Our result is the float32 formula rounded once to bfloat16; the float32 formula may be
    # contracted to FMAs, which moves a result across a rounding boundary now and then.
    q, k, cos, sin = make_inputs(shape, torch.bfloat16, cos_dtype)
    ours = rotary(q, k, cos, sin)
    expected = rotary_reference(q, k, cos, sin, upcast=True)
    for got, want in zip(ours, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-12)
        assert (got != want).float().mean().item() < 1e-3
    grad_q_out, grad_k_out = torch.randn_like(q), torch.randn_like(k)
    torch.testing.assert_close(
        torch.ops.llmsys_fused.rotary_bwd(grad_q_out, grad_k_out, cos, sin),
        rotary_backward_reference(grad_q_out, grad_k_out, cos, sin),
        rtol=2**-7,
        atol=2**-12,
    )


def test_hf_layout_is_kept_and_matches_transformers():
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    q, k, cos, sin = make_inputs(LLAMA_SHAPES[0], torch.float32)
    q_out, k_out = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    expected = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close((q_out, k_out), expected, rtol=1e-6, atol=1e-6)


def test_more_than_2_to_the_31_elements():
    # q and k each hold 2**31 + 384 elements; offsets must be 64-bit. cos and sin repeat one
    # row (stride 0 over positions) to save memory.
    seq_len, head_dim = (1 << 24) + 3, 128
    q = torch.randn(1, 1, seq_len, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, seq_len, head_dim, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(1, 1, head_dim // 2, device="cuda") * 6.28
    emb = torch.cat((angles, angles), dim=-1)
    cos = emb.cos().to(torch.bfloat16).expand(1, seq_len, head_dim)
    sin = emb.sin().to(torch.bfloat16).expand(1, seq_len, head_dim)
    q_out, k_out = rotary(q, k, cos, sin)
    for x, out in ((q, q_out), (k, k_out)):
        for part in (slice(0, 5), slice(seq_len - 5, seq_len)):
            expected, _ = rotary_reference(
                x[:, :, part], x[:, :, part], cos[:, part], sin[:, part], upcast=True
            )
            torch.testing.assert_close(out[:, :, part], expected, rtol=2**-7, atol=2**-12)
    del q, k, q_out, k_out
    torch.cuda.empty_cache()


def test_forward_and_backward_ops_replay_in_a_cuda_graph():
    def fresh():
        q, k, cos, sin = make_inputs((2, 6, 2, 33, 64), torch.bfloat16)
        return [q, k, cos, sin]

    static, new = fresh(), fresh()
    out = replay_in_cuda_graph(torch.ops.llmsys_fused.rotary_fwd, static, new)
    expected = torch.ops.llmsys_fused.rotary_fwd(*new)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))

    def fresh_grads():
        _, _, cos, sin = make_inputs((2, 6, 2, 33, 64), torch.bfloat16)
        grad_q_out = torch.randn(2, 6, 33, 64, device="cuda", dtype=torch.bfloat16)
        grad_k_out = torch.randn(2, 2, 33, 64, device="cuda", dtype=torch.bfloat16)
        return [grad_q_out, grad_k_out, cos, sin]

    static, new = fresh_grads(), fresh_grads()
    out = replay_in_cuda_graph(torch.ops.llmsys_fused.rotary_bwd, static, new)
    expected = torch.ops.llmsys_fused.rotary_bwd(*new)
    assert all(torch.equal(o, e) for o, e in zip(out, expected, strict=True))


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_forward_and_backward_match_eager(mode):
    def forward(q, k, cos, sin):
        q_out, k_out = rotary(q * 2, k, cos, sin)
        return q_out.float().square().sum() + k_out.float().sum()

    def step(fn, q, k, cos, sin):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        loss = fn(q, k, cos, sin)
        return (loss, *torch.autograd.grad(loss, (q, k)))

    compiled = torch.compile(forward, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records on the first calls, replays after
        inputs = make_inputs((2, 8, 2, 65, 128), torch.bfloat16)
        got, expected = step(compiled, *inputs), step(forward, *inputs)
        # the loss is summed in another order by inductor; the gradients are bfloat16
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)


def test_compiled_inference_matches_eager_bit_for_bit():
    compiled = torch.compile(rotary, fullgraph=True)
    q, k, cos, sin = make_inputs(LLAMA_SHAPES[0], torch.bfloat16)
    got, expected = compiled(q, k, cos, sin), rotary(q, k, cos, sin)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
