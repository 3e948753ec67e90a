"""Tests for the int8 KV cache (issue 46): ``append_kv_int8`` against the reference quantizer,
exactly; ``decode_attention`` over an int8 cache against the float64 spec of the dequantized
cache, with its error against the unquantized cache measured and bounded.

CPU: the kernels under Triton's interpreter at tiny sizes, as in test_decode.py. GPU: the
Llama-3.1-8B shape, exact quantization with the GPU's rint, and a decode step (append, then
attend) replayed in a CUDA graph.
"""

from pathlib import Path

import pytest
import torch
from attn_helpers import REL_TOL, relative_error
from decode_helpers import SMALL_CHUNK, decode_reference, make_cache, set_decode_switch

from llmsys.bench_harness import load_beside, read_rows
from llmsys.flash_attn2 import (
    append_kv_int8,
    decode,
    decode_attention,
    kv_cache_int8,
    ops,
    quantize_kv_int8_reference,
)
from llmsys.triton_launch import forget

# Relative (norm-wise) error of attention over the int8 cache against attention over the float
# cache it was quantized from, both float64 specs: per-token absmax int8 rounds each element by
# at most half a step of max|row| / 127. Measured on these tests' Gaussian caches: 4e-3 to 7e-3
# (the benchmark's CSV reports it at the Llama-3.1-8B shape).
INT8_CACHE_REL_ERROR = 1.5e-2
POISON_Q, POISON_SCALE = 55, -7.0  # what a cache holds where the append must not write


def int8_cache(batch, kv_heads, capacity, head_dim, device, layout="sliced"):
    """(k_cache, v_cache, k_scale, v_scale): int8 caches and float32 scales, poisoned, as views
    in ``layout``: "contiguous"; "sliced" (the first ``capacity`` rows of a longer buffer);
    "token-major" (a (B, capacity, H_KV, D) buffer transposed, scales (B, capacity, H_KV))."""
    tensors = []
    for shape, value in (((head_dim,), POISON_Q), ((), POISON_SCALE)):
        dtype = torch.int8 if shape else torch.float32
        for _ in "kv":
            if layout == "token-major":
                buf = torch.full((batch, capacity, kv_heads, *shape), value, dtype=dtype)
                t = buf.transpose(1, 2)
            elif layout == "sliced":
                buf = torch.full((batch, kv_heads, capacity + 5, *shape), value, dtype=dtype)
                t = buf[:, :, :capacity]
            else:
                t = torch.full((batch, kv_heads, capacity, *shape), value, dtype=dtype)
            tensors.append(t.to(device))
    return tensors


def quantize_caches(k_cache, v_cache, layout="sliced"):
    """The int8 cache of float caches ``(B, H_KV, CAPACITY, D)``: every row appended at once."""
    batch, kv_heads, capacity, head_dim = k_cache.shape
    cache = int8_cache(batch, kv_heads, capacity, head_dim, k_cache.device, layout)
    starts = torch.zeros(batch, dtype=torch.int32, device=k_cache.device)
    append_kv_int8(k_cache, v_cache, *cache, starts)
    return cache


def dequantized(q, scale):
    return q.double() * scale.double()[..., None]


# --- the append ----------------------------------------------------------------------------------


def new_tokens(batch, kv_heads, n_new, head_dim, dtype, device, token_major):
    """Fresh keys (B, H_KV, N_NEW, D), as a transposed (B, N_NEW, H_KV, D) buffer when
    ``token_major``, with planted rows: all zeros, a NaN, an Inf, and exact halves of the step
    (round half to even), which a random row never holds."""
    if token_major:
        x = torch.randn(batch, n_new, kv_heads, head_dim, device=device).transpose(1, 2)
    else:
        x = torch.randn(batch, kv_heads, n_new, head_dim, device=device)
    x[0, 0, 0] = 0.0
    if n_new > 1:
        x[-1, -1, 1, 3] = float("nan")
        x[0, -1, 1, 0] = float("inf")
        halves = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5], device=device)
        x[-1, 0, -1, : min(head_dim, 7)] = halves[:head_dim]  # scale 1: y is exact
    return x.to(dtype)


def check_append(k_new, v_new, cache, starts):
    """``cache`` holds the reference quantization of the new rows at ``starts``, poison
    elsewhere (the rows before and after are untouched)."""
    k_cache, v_cache, k_scale, v_scale = cache
    n_new = k_new.shape[2]
    for new, q_cache, scale in ((k_new, k_cache, k_scale), (v_new, v_cache, v_scale)):
        want_q, want_scale = quantize_kv_int8_reference(new.cpu())
        q_cache, scale = q_cache.cpu(), scale.cpu()
        for b, start in enumerate(starts):
            rows = slice(start, start + n_new)
            assert torch.equal(q_cache[b, :, rows], want_q[b]), f"sequence {b}: int8 values"
            torch.testing.assert_close(
                scale[b, :, rows], want_scale[b], rtol=0, atol=0, equal_nan=True
            )
            untouched = torch.ones(q_cache.shape[2], dtype=torch.bool)
            untouched[rows] = False
            assert (q_cache[b, :, untouched] == POISON_Q).all(), f"sequence {b}: wrote outside"
            assert (scale[b, :, untouched] == POISON_SCALE).all()


# (batch, kv_heads, capacity, head_dim, n_new, starts, dtype, layout, token-major new tokens):
# starts from 0 to the capacity's end, a decode step (1 token), a speculative step (5), a
# prompt of 37 (3 blocks of 16 tokens), head dims 24 (padded to 32) and 16.
APPEND_CASES = {
    "step1-fp32": (3, 2, 40, 24, 1, [0, 17, 39], torch.float32, "sliced", False),
    "step5-fp16": (3, 2, 40, 24, 5, [0, 17, 35], torch.float16, "token-major", True),
    "step5-bf16": (2, 1, 24, 16, 5, [19, 4], torch.bfloat16, "contiguous", False),
    "prompt37-fp16": (2, 2, 48, 16, 37, [0, 11], torch.float16, "sliced", True),
}


@pytest.mark.parametrize("case", list(APPEND_CASES))
def test_append_matches_the_reference_quantizer(case, device):
    batch, kv_heads, capacity, head_dim, n_new, starts, dtype, layout, token_major = APPEND_CASES[
        case
    ]
    k_new = new_tokens(batch, kv_heads, n_new, head_dim, dtype, device, token_major)
    v_new = new_tokens(batch, kv_heads, n_new, head_dim, dtype, device, token_major)
    cache = int8_cache(batch, kv_heads, capacity, head_dim, device, layout)
    append_kv_int8(k_new, v_new, *cache, torch.tensor(starts, device=device))
    check_append(k_new, v_new, cache, starts)


def test_append_cpu_fallback_matches_triton(monkeypatch):
    # Without TRITON_INTERPRET, CPU tensors take the reference quantizer and an indexed copy.
    k_new = new_tokens(2, 2, 5, 16, torch.bfloat16, "cpu", True)
    v_new = new_tokens(2, 2, 5, 16, torch.bfloat16, "cpu", False)
    starts = torch.tensor([3, 0])
    triton_path = int8_cache(2, 2, 12, 16, "cpu")
    append_kv_int8(k_new, v_new, *triton_path, starts)
    monkeypatch.setattr(ops, "CPU_RUNS_TRITON", False)
    forget(kv_cache_int8.flash_attn2_append_kv_int8)
    fallback = int8_cache(2, 2, 12, 16, "cpu")
    append_kv_int8(k_new, v_new, *fallback, starts)
    for got, want in zip(fallback, triton_path, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# --- decode over the int8 cache ------------------------------------------------------------------


def check_int8_decode(batch, heads, kv_heads, q_len, capacity, head_dim, lengths, dtype, device,
                      layout):  # fmt: skip
    """Decode over the int8 quantization of a fresh float cache (NaN past each length, so the
    NaN scales there must not leak): within the dtype's tolerance of the float64 spec of the
    dequantized cache, and within INT8_CACHE_REL_ERROR of the float cache's spec. Returns that
    error."""
    q = torch.randn(batch, heads, q_len, head_dim, device=device).to(dtype)
    k_float, v_float = make_cache(batch, kv_heads, capacity, head_dim, lengths, dtype, device)
    k_cache, v_cache, k_scale, v_scale = quantize_caches(k_float, v_float, layout)
    seqlens = torch.tensor(lengths, device=device, dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, seqlens, k_scale=k_scale, v_scale=v_scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "non-finite output: garbage or an unwritten element leaked"
    want = decode_reference(
        q, dequantized(k_cache, k_scale), dequantized(v_cache, v_scale), lengths
    )
    tol = REL_TOL[(torch.device(device).type, dtype)]
    error = relative_error(out, want)
    assert error <= tol, f"against the dequantized cache: relative error {error:.2e} > {tol:.0e}"
    float_spec = decode_reference(q, k_float, v_float, lengths)
    cache_error = relative_error(want, float_spec)
    assert 0 < cache_error <= INT8_CACHE_REL_ERROR, f"int8 cache error {cache_error:.2e}"
    return cache_error


# (batch, heads, kv_heads, q_len, capacity, head_dim, lengths, dtype, layout of the int8 cache):
# query lengths 1, 3 and 16; GQA ratios 1, 4 and 8; each batch holds its shortest length (Q_LEN),
# the full capacity and one that ends inside a chunk.
CASES = {
    "q1-mha-fp32": (3, 2, 2, 1, 64, 16, [1, 64, 37], torch.float32, "sliced"),
    "q1-gqa8-bf16": (2, 8, 1, 1, 48, 32, [48, 1], torch.bfloat16, "token-major"),
    "q3-gqa4-fp16-d24": (3, 8, 2, 3, 64, 24, [3, 64, 18], torch.float16, "contiguous"),
    "q16-gqa8-fp32": (2, 8, 1, 16, 48, 16, [16, 48], torch.float32, "token-major"),
    "q16-gqa4-bf16": (2, 4, 1, 16, 48, 16, [33, 16], torch.bfloat16, "sliced"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_int8_cache_matches_the_dequantized_spec(case, device, monkeypatch, poisoned_allocations):
    set_decode_switch(monkeypatch, "CHUNK", SMALL_CHUNK)
    check_int8_decode(*CASES[case][:-1], device, layout=CASES[case][-1])


def test_decode_steps_append_then_attend(device, monkeypatch):
    # A prompt per sequence (ragged), then two steps of 2 tokens: each step appends at the
    # lengths on the device and attends with the lengths advanced, as a serving loop does.
    set_decode_switch(monkeypatch, "CHUNK", SMALL_CHUNK)
    batch, heads, kv_heads, capacity, head_dim, step = 2, 4, 2, 40, 16, 2
    prompts = [7, 30]
    k_all = torch.randn(batch, kv_heads, capacity, head_dim, device=device, dtype=torch.float16)
    v_all = torch.randn_like(k_all)
    cache = int8_cache(batch, kv_heads, capacity, head_dim, device)
    seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
    for b, n in enumerate(prompts):  # the prompts, one sequence at a time
        append_kv_int8(k_all[b : b + 1, :, :n], v_all[b : b + 1, :, :n],
                       *(t[b : b + 1] for t in cache), seqlens[b : b + 1])  # fmt: skip
    seqlens += torch.tensor(prompts, dtype=torch.int32, device=device)
    k_ref, v_ref = (torch.full_like(t, float("nan"), dtype=torch.float64) for t in (k_all, v_all))
    for _ in range(2):
        rows = seqlens[:, None].long().cpu() + torch.arange(step)  # (B, step): the new rows
        k_new = torch.stack([k_all[b, :, rows[b]] for b in range(batch)])  # (B, H_KV, step, D)
        v_new = torch.stack([v_all[b, :, rows[b]] for b in range(batch)])
        append_kv_int8(k_new, v_new, *cache, seqlens)
        seqlens += step
        q = torch.randn(batch, heads, step, head_dim, device=device, dtype=torch.float16)
        out = decode_attention(q, cache[0], cache[1], seqlens, k_scale=cache[2], v_scale=cache[3])
        lengths = seqlens.tolist()
        for b, length in enumerate(lengths):  # the spec: every token so far, quantized alone
            k_ref[b, :, :length] = dequantized(*quantize_kv_int8_reference(k_all[b, :, :length]))
            v_ref[b, :, :length] = dequantized(*quantize_kv_int8_reference(v_all[b, :, :length]))
        want = decode_reference(q, k_ref, v_ref, lengths)
        assert relative_error(out, want) <= REL_TOL[(torch.device(device).type, torch.float16)]


def test_int8_decode_cpu_fallback_matches_triton(monkeypatch):
    set_decode_switch(monkeypatch, "CHUNK", SMALL_CHUNK)
    lengths = [3, 40, 20]
    q = torch.randn(3, 4, 3, 16)
    cache = quantize_caches(*make_cache(3, 2, 40, 16, lengths, torch.float32, "cpu"))
    seqlens = torch.tensor(lengths)
    triton_path = decode_attention(q, *cache[:2], seqlens, k_scale=cache[2], v_scale=cache[3])
    monkeypatch.setattr(ops, "CPU_RUNS_TRITON", False)
    forget(decode.flash_attn2_decode)
    fallback = decode_attention(q, *cache[:2], seqlens, k_scale=cache[2], v_scale=cache[3])
    assert torch.isfinite(fallback).all()
    assert relative_error(fallback, triton_path) <= 1e-5


# --- the ops by name -----------------------------------------------------------------------------


def test_ops_trace_on_meta_and_refuse_grad():
    k_new, v_new = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    cache = int8_cache(2, 2, 16, 8, "cpu")
    starts = torch.tensor([0, 13])
    meta = [t.to("meta") for t in (k_new, v_new, *cache, starts)]
    torch.ops.llmsys.flash_attn2_append_kv_int8(*meta)
    q = torch.randn(2, 4, 3, 8, device="meta")
    out = torch.ops.llmsys.flash_attn2_decode(q, *meta[2:4], meta[6], 0.5, *meta[4:6])
    assert out.shape == (2, 4, 3, 8) and out.device.type == "meta"

    k_grad = k_new.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        append_kv_int8(k_grad, v_new, *cache, starts)
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.ops.llmsys.flash_attn2_append_kv_int8(k_grad, v_new, *cache, starts)
    assert (cache[0] == POISON_Q).all(), "a refused call wrote the cache"
    with torch.no_grad():
        append_kv_int8(k_grad, v_new, *cache, starts)
    check_append(k_new, v_new, cache, [0, 13])


def test_opcheck_append(device):
    # The schema's in-place annotations, the fake and the impl agree (the decode op's optional
    # scales meet its fake in test_compiled_step_matches_eager).
    k_new, v_new = torch.randn(2, 2, 3, 8, device=device), torch.randn(2, 2, 3, 8, device=device)
    args = (k_new, v_new, *int8_cache(2, 2, 16, 8, device), torch.tensor([0, 13], device=device))
    torch.library.opcheck(torch.ops.llmsys.flash_attn2_append_kv_int8.default, args)


def test_compiled_step_matches_eager(device):
    # An append and a decode in one fullgraph-compiled step (the in-place op functionalized).
    def step(q, k_new, v_new, k_cache, v_cache, k_scale, v_scale, seqlens):
        append_kv_int8(k_new, v_new, k_cache, v_cache, k_scale, v_scale, seqlens)
        return decode_attention(q, k_cache, v_cache, seqlens + 1, k_scale=k_scale, v_scale=v_scale)

    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    q = torch.randn(2, 4, 1, 8, device=device)
    k_new, v_new = torch.randn(2, 2, 1, 8, device=device), torch.randn(2, 2, 1, 8, device=device)
    seqlens = torch.tensor([4, 9], device=device)
    cache = quantize_caches(*make_cache(2, 2, 16, 8, [9, 9], torch.float32, device))
    copy = [t.clone() for t in cache]
    got = compiled(q, k_new, v_new, *cache, seqlens)
    want = step(q, k_new, v_new, *copy, seqlens)
    torch.testing.assert_close(got, want)
    for t, u in zip(cache, copy, strict=True):
        torch.testing.assert_close(t, u, rtol=0, atol=0, equal_nan=True)


def test_error_report_script_runs_on_cpu(tmp_path):
    # benchmarks/decode_int8_kv.py --quick on CPU: the error rows of one tiny case, in a CSV.
    script = Path(__file__).parents[1] / "benchmarks" / "decode_int8_kv.py"
    rows = load_beside(script, "decode_int8_kv").main(
        ["--device", "cpu", "--quick", "--out", str(tmp_path)]
    )
    written = read_rows(tmp_path / "decode_int8_kv_cpu.csv")
    assert len(written) == len(rows) == 8  # 4 error rows for each kind of keys
    errors = {(r.provider, r.mode, r.config): r.throughput for r in written}
    for keys in ("gaussian", "outlier channels"):
        fp16 = errors["fp16 cache", "relative error vs float64 spec", f"keys: {keys}"]
        int8 = errors["int8 cache", "relative error vs float64 spec", f"keys: {keys}"]
        assert 0 < fp16 < int8 < 5e-2, (keys, fp16, int8)


# --- bad input -----------------------------------------------------------------------------------


def good_append_args(**change):
    k_cache, v_cache, k_scale, v_scale = int8_cache(2, 2, 16, 8, "cpu", "contiguous")
    args = {
        "k_new": torch.randn(2, 2, 3, 8),
        "v_new": torch.randn(2, 2, 3, 8),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "k_scale": k_scale,
        "v_scale": v_scale,
        "cache_seqlens": torch.tensor([0, 13], dtype=torch.int32),
    }
    return args | change


def meta(t):
    return t.to("meta")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k_new": [1.0]}, TypeError, r"`k_new` must be a torch.Tensor"),
        ({"v_scale": None}, TypeError, r"`v_scale` must be a torch.Tensor"),
        ({"k_new": torch.randn(2, 2, 3, 8).double()}, TypeError, r"`k_new` must have dtype in"),
        ({"v_new": torch.randn(2, 2, 3, 8).half()}, TypeError, r"`v_new` must have the dtype"),
        (
            {"k_cache": torch.zeros(2, 2, 16, 8)},
            TypeError,
            r"`k_cache` must have dtype in \(int8\)",
        ),
        (
            {"v_scale": torch.zeros(2, 2, 16, dtype=torch.float16)},
            TypeError,
            r"`v_scale` must have dtype in \(float32\)",
        ),
        ({"k_new": torch.randn(2, 3, 8)}, ValueError, r"`k_new` must be 4-D"),
        ({"v_new": torch.randn(2, 2, 4, 8)}, ValueError, r"`v_new` must have the shape"),
        (
            {"k_cache": torch.zeros(2, 1, 16, 8, dtype=torch.int8)},
            ValueError,
            r"`k_cache` must be \(batch, kv_heads, capacity, head_dim\) .* got \(2, 1, 16, 8\)",
        ),
        (
            {"k_cache": torch.zeros(2, 2, 16, 4, dtype=torch.int8)},
            ValueError,
            r"`k_cache` must be .* head_dim",
        ),
        (
            {"v_cache": torch.zeros(2, 2, 15, 8, dtype=torch.int8)},
            ValueError,
            r"`v_cache` must have the shape",
        ),
        (
            {"k_scale": torch.zeros(2, 2, 15)},
            ValueError,
            r"`k_scale` must have shape \(2, 2, 16\) .* got \(2, 2, 15\)",
        ),
        (
            {"cache_seqlens": torch.tensor([0.0, 3.0])},
            TypeError,
            r"`cache_seqlens` must have dtype in \(int32, int64\)",
        ),
        (
            {"cache_seqlens": torch.tensor([0, 3, 5])},
            ValueError,
            r"`cache_seqlens` must have shape \(2,\)",
        ),
        (
            {"cache_seqlens": torch.tensor([0, 14])},
            ValueError,
            r"`cache_seqlens` must be between 0 and the capacity 16 less the 3 new tokens, got "
            r"values from 0 to 14",
        ),
        (
            {"cache_seqlens": torch.tensor([-1, 3])},
            ValueError,
            r"`cache_seqlens` must be between 0 .* from -1 to 3",
        ),
        (
            {"k_scale": meta(torch.zeros(2, 2, 16))},
            ValueError,
            r"`k_scale` must be on the device of `k_new`",
        ),
        (
            {"cache_seqlens": meta(torch.tensor([0, 3]))},
            ValueError,
            r"`cache_seqlens` must be on the device of `k_new`",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_append_inputs_raise(change, error, match):
    args = good_append_args(**change)
    before = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(error, match=match):
        append_kv_int8(**args)
    assert all(torch.equal(args[name], t) for name, t in before.items() if t.device.type != "meta")


def good_decode_args(**change):
    k_cache, v_cache, k_scale, v_scale = int8_cache(2, 2, 16, 8, "cpu", "contiguous")
    args = {
        "q": torch.randn(2, 4, 3, 8),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "cache_seqlens": torch.tensor([3, 16], dtype=torch.int32),
        "k_scale": k_scale.abs(),
        "v_scale": v_scale.abs(),
    }
    return args | change


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k_scale": None}, ValueError, r"an int8 `k_cache` needs `k_scale` .* got None"),
        ({"v_scale": None}, ValueError, r"an int8 `k_cache` needs `v_scale`"),
        (
            {"k_cache": torch.randn(2, 2, 16, 8), "v_cache": torch.randn(2, 2, 16, 8)},
            ValueError,
            r"`k_scale` goes with an int8 cache, but `k_cache` has dtype torch.float32",
        ),
        (
            {
                "k_cache": torch.randn(2, 2, 16, 8),
                "v_cache": torch.randn(2, 2, 16, 8),
                "k_scale": None,
            },
            ValueError,
            r"`v_scale` goes with an int8 cache",
        ),
        ({"v_cache": torch.randn(2, 2, 16, 8)}, TypeError, r"`v_cache` must have the dtype of"),
        (
            {"k_cache": torch.zeros(2, 2, 16, 8, dtype=torch.int16)},
            TypeError,
            r"`k_cache` must have dtype in \(float16, bfloat16, float32, int8\)",
        ),
        ({"k_scale": [1.0]}, TypeError, r"`k_scale` must be a torch.Tensor"),
        (
            {"k_scale": torch.ones(2, 2, 16, dtype=torch.bfloat16)},
            TypeError,
            r"`k_scale` must have dtype in \(float32\), got torch.bfloat16",
        ),
        (
            {"v_scale": torch.ones(2, 2, 1)},
            ValueError,
            r"`v_scale` must have shape \(2, 2, 16\) .* got \(2, 2, 1\)",
        ),
        ({"v_scale": meta(torch.ones(2, 2, 16))}, ValueError, r"`v_scale` must be on the device"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_int8_decode_inputs_raise(change, error, match):
    with pytest.raises(error, match=match):
        decode_attention(**good_decode_args(**change))


# --- GPU only: the Llama-3.1-8B shape, CUDA graphs -----------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_append_is_exact_at_the_llama_shape(dtype):
    # The GPU rounds with rint (the interpreter with a float trick): both must be torch.round.
    k_new = new_tokens(4, 8, 300, 128, dtype, "cuda", True) * 3
    v_new = new_tokens(4, 8, 300, 128, dtype, "cuda", False) / 50
    cache = int8_cache(4, 8, 1024, 128, "cuda", "token-major")
    starts = [0, 1, 700, 724]
    append_kv_int8(k_new, v_new, *cache, torch.tensor(starts, device="cuda"))
    check_append(k_new, v_new, cache, starts)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_cuda_graph_step_replays_with_new_lengths(q_len):
    # One decode step, the append and the attention, captured once and replayed for new lengths.
    batch, heads, kv_heads, capacity, head_dim = 4, 32, 8, 4096, 128
    dtype = torch.bfloat16
    k_float, v_float = make_cache(
        batch, kv_heads, capacity, head_dim, [capacity] * 4, dtype, "cuda"
    )
    cache = quantize_caches(k_float, v_float)
    q = torch.randn(batch, heads, q_len, head_dim, device="cuda", dtype=dtype)
    k_new, v_new = (torch.randn(batch, kv_heads, q_len, head_dim, device="cuda", dtype=dtype)
                    for _ in "kv")  # fmt: skip
    starts = torch.zeros(batch, dtype=torch.int32, device="cuda")

    def step():
        append_kv_int8(k_new, v_new, *cache, starts)
        return decode_attention(
            q, cache[0], cache[1], starts + q_len, k_scale=cache[2], v_scale=cache[3]
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new_starts in ([0, 1000, capacity - q_len, 2500], [17, 0, 3333, 4000]):
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        starts.copy_(torch.tensor(new_starts, device="cuda", dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert torch.equal(out, eager), "the replay differs from an eager call"
        lengths = [s + q_len for s in new_starts]
        k_deq, v_deq = dequantized(cache[0], cache[2]), dequantized(cache[1], cache[3])
        want = decode_reference(q, k_deq, v_deq, lengths)
        assert torch.isfinite(out).all()
        assert relative_error(out, want) <= REL_TOL[("cuda", dtype)]
        rows = torch.arange(q_len, device="cuda")
        for b, start in enumerate(new_starts):
            want_q, _ = quantize_kv_int8_reference(k_new[b])
            assert torch.equal(cache[0][b, :, start + rows], want_q)


@pytest.mark.gpu
def test_gpu_int8_cache_default_chunk_against_the_spec():
    error = check_int8_decode(3, 32, 8, 16, 2048, 128, [16, 777, 2048], torch.float16, "cuda",
                              "sliced")  # fmt: skip
    print(f"int8 cache vs fp16 cache, relative error of the attention output: {error:.2e}")
