"""rotary_into_cache on the GPU: Llama decode shapes against the spec (``rotary_reference`` and
an indexed copy), bit for bit against ``rotary``, a cache of more than 2**31 elements, rows
outside the cache dropped, CUDA-graph replay with other lengths, inductor."""

import pytest
import torch

from llmsys.kernels_fused import rotary, rotary_into_cache, rotary_reference
from llmsys.triton_launch.testing import replay_in_cuda_graph

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (batch, q heads, kv heads, new tokens, capacity, head_dim): Llama-3-8B decode steps of 1 and
# 16 tokens over a 4096-token cache, odd sizes.
SHAPES = [(8, 32, 8, 1, 4096, 128), (4, 32, 8, 16, 4096, 128), (3, 6, 2, 5, 77, 64)]
# (rtol, atol): a rounding boundary may fall between our float32 result (FMAs) and eager's
TOL = {
    torch.float32: (1.3e-6, 1e-6),
    torch.bfloat16: (2**-7, 2**-12),
    torch.float16: (2**-10, 2**-16),
}


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


def make_inputs(batch, n_q, n_kv, n_new, capacity, head_dim, dtype, lengths):
    """q, k, v as Hugging Face makes them, cos and sin as Llama's rotary module does, a cache
    of random older tokens with NaN past each length, the lengths as int32."""
    q, k, v = (
        torch.randn(batch, n_new, n * head_dim, device="cuda")
        .to(dtype)
        .view(batch, n_new, n, head_dim)
        .transpose(1, 2)
        for n in (n_q, n_kv, n_kv)
    )
    inv_freq = 500000.0 ** -(torch.arange(0, head_dim, 2, device="cuda").double() / head_dim)
    positions = torch.tensor(lengths, device="cuda").double()[:, None] + torch.arange(
        n_new, device="cuda"
    )
    freqs = positions[..., None] * inv_freq  # (batch, n_new, head_dim // 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    caches = [torch.randn(batch, n_kv, capacity, head_dim, device="cuda").to(dtype)
              for _ in "kv"]  # fmt: skip
    for cache in caches:
        for b, length in enumerate(lengths):
            cache[b, :, length:] = float("nan")
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return [q, k, v, emb.cos().to(dtype), emb.sin().to(dtype), *caches, seqlens]


def spec(q, k, v, cos, sin, k_cache, v_cache, seqlens):
    """(q_out, k_cache, v_cache): rotary_reference in float32, new rows copied into clones."""
    q_out, k_out = rotary_reference(q, k, cos, sin, upcast=True)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    n_new = k.shape[2]
    for b, start in enumerate(seqlens.tolist()):
        k_cache[b, :, start : start + n_new] = k_out[b]
        v_cache[b, :, start : start + n_new] = v[b]
    return q_out, k_cache, v_cache


def assert_matches(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[1], want[1], rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matches_the_spec_and_rotary(shape, dtype):
    batch, *_, n_new, capacity, _ = shape
    # lengths from 0 to capacity - n_new, the ends included
    lengths = torch.randint(0, capacity - n_new + 1, (batch,)).tolist()
    lengths[0], lengths[-1] = 0, capacity - n_new
    args = make_inputs(*shape, dtype, lengths)
    want = spec(*args)
    q_out = rotary_into_cache(*args)
    assert_matches((q_out, args[5], args[6]), want, dtype)
    q_rot, k_rot = rotary(*args[:2], *args[3:5])  # the same rotation, bit for bit
    assert torch.equal(q_out, q_rot)
    for b, start in enumerate(lengths):
        assert torch.equal(args[5][b, :, start : start + n_new], k_rot[b])


def test_a_cache_of_more_than_2_to_the_31_elements():
    # Each cache holds 2**31 + 384 elements; the rows written are past 2**31: 64-bit offsets.
    capacity, head_dim = (1 << 24) + 3, 128
    args = make_inputs(1, 4, 1, 2, 16, head_dim, torch.bfloat16, [0])
    k_cache, v_cache = (torch.zeros(1, 1, capacity, head_dim, device="cuda",
                                    dtype=torch.bfloat16) for _ in "kv")  # fmt: skip
    start = capacity - 2
    q_out = rotary_into_cache(*args[:5], k_cache, v_cache, torch.tensor([start], device="cuda"))
    q_rot, k_rot = rotary(*args[:2], *args[3:5])
    assert torch.equal(q_out, q_rot)
    assert torch.equal(k_cache[:, :, start:], k_rot) and torch.equal(v_cache[:, :, start:], args[2])
    assert not k_cache[:, :, :start].any() and not v_cache[:, :, :start].any()
    del k_cache, v_cache
    torch.cuda.empty_cache()


def test_rows_outside_the_cache_are_dropped():
    # CUDA lengths are not checked: rows below 0 or past the capacity are not written.
    args = make_inputs(3, 4, 2, 3, 6, 8, torch.float32, [6, 6, 6])
    args[-1] = torch.tensor([-2, 5, 1 << 40], device="cuda")  # rows -2..0, 5..7, 2**40..
    cached = spec(*args[:-1], torch.zeros(3, dtype=torch.int64, device="cuda"))
    k_want, v_want = args[5].clone(), args[6].clone()
    k_want[0, :, 0], v_want[0, :, 0] = cached[1][0, :, 2], cached[2][0, :, 2]
    k_want[1, :, 5], v_want[1, :, 5] = cached[1][1, :, 0], cached[2][1, :, 0]
    q_out = rotary_into_cache(*args)
    torch.testing.assert_close(q_out, cached[0])
    torch.testing.assert_close(
        args[5], k_want, rtol=TOL[torch.float32][0], atol=TOL[torch.float32][1]
    )
    torch.testing.assert_close(args[6], v_want, rtol=0, atol=0)


def test_replays_in_a_cuda_graph_for_other_lengths():
    # Captured once (lengths 3 and 40), replayed with fresh inputs and other lengths (the
    # stride-0 length transformers keeps, expanded, would replay the same way).
    static = make_inputs(2, 8, 2, 4, 64, 64, torch.bfloat16, [3, 40])
    fresh = make_inputs(2, 8, 2, 4, 64, 64, torch.bfloat16, [17, 60])
    want = spec(*fresh)
    q_out = replay_in_cuda_graph(rotary_into_cache, static, fresh)
    assert_matches((q_out, static[5], static[6]), want, torch.bfloat16)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_inductor_step_matches_eager(mode):
    def step(q, k, v, cos, sin, k_cache, v_cache, seqlens):
        q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, seqlens)
        return q_out.float().square().sum(), k_cache.float().nan_to_num().sum()

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    for lengths in ([3, 40], [9, 20], [0, 59]):  # reduce-overhead records, then replays
        args = make_inputs(2, 8, 2, 4, 64, 64, torch.bfloat16, lengths)
        copies = [t.clone() for t in args]
        got, want = compiled(*args), step(*copies)
        torch.testing.assert_close(got, want)
        for compiled_cache, eager_cache in zip(args[5:7], copies[5:7], strict=True):
            torch.testing.assert_close(compiled_cache, eager_cache, equal_nan=True)
