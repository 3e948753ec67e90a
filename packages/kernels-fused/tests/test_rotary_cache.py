"""Tests for llmsys.kernels_fused.rotary_into_cache (issue 46): rotary on q and k with k and v
appended to a KV cache, in one launch, against an independent spec: ``rotary_reference`` (float32,
rounded once) and an indexed copy into a clone of the cache.

On CPU the kernel runs under Triton's interpreter, whose float32 -> 16-bit cast truncates: the
16-bit rotated values are then within one ulp of the reference's rounded ones (``TOL``); the
values are copied, so they match exactly everywhere. Every cache starts as random "older
tokens" up to each sequence's length and NaN after it: a row the kernel should write and does
not stays NaN, a row it should not touch and does is no longer what the clone holds."""

import functools
import importlib

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from llmsys.kernels_fused import rotary, rotary_into_cache, rotary_reference
from llmsys.triton_launch import forget

cache_module = importlib.import_module("llmsys.kernels_fused.rotary_cache")
rotary_module = importlib.import_module("llmsys.kernels_fused.rotary")
op = torch.ops.llmsys_fused.rotary_into_cache

# (rtol, atol) against the reference: one ulp of a 16-bit dtype (truncation, see above).
TOL = {
    torch.float32: (1.3e-6, 1e-6),
    torch.bfloat16: (2**-7, 2**-12),
    torch.float16: (2**-10, 2**-16),
}


def cos_sin(batch, n_new, head_dim, dtype, device):
    """(cos, sin) ``(batch, n_new, head_dim)`` with equal halves, as Llama's rotary makes them."""
    angles = torch.rand(batch, n_new, head_dim // 2, dtype=torch.float64) * 1000
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def projections(batch, n_q, n_kv, n_new, head_dim, dtype, device, layout="hf"):
    """(q, k, v) ``(B, H, N_NEW, D)``: "hf", each ``proj(x).view(B, N, H, D).transpose(1, 2)``;
    "fused", column ranges of one q|k|v projection (not dense); "contiguous"."""
    if layout == "contiguous":
        shapes = ((batch, n, n_new, head_dim) for n in (n_q, n_kv, n_kv))
        return [torch.randn(shape, device=device).to(dtype) for shape in shapes]
    if layout == "fused":
        qkv = torch.randn(batch, n_new, (n_q + 2 * n_kv) * head_dim, device=device).to(dtype)
        parts = qkv.split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    else:
        parts = [torch.randn(batch, n_new, n * head_dim, device=device).to(dtype)
                 for n in (n_q, n_kv, n_kv)]  # fmt: skip
    return [p.view(batch, n_new, n, head_dim).transpose(1, 2)
            for p, n in zip(parts, (n_q, n_kv, n_kv), strict=True)]  # fmt: skip


def old_cache(batch, n_kv, capacity, head_dim, lengths, dtype, device, layout="contiguous"):
    """A ``(B, H_KV, capacity, D)`` cache view: random up to each length, NaN after.
    ``layout``: "contiguous"; "sliced", the first ``capacity`` rows of a longer buffer;
    "token-major", a ``(B, capacity, H_KV, D)`` buffer transposed."""
    if layout == "token-major":
        buf = torch.randn(batch, capacity, n_kv, head_dim, device=device).to(dtype)
        cache = buf.transpose(1, 2)
    elif layout == "sliced":
        buf = torch.randn(batch, n_kv, capacity + 3, head_dim, device=device).to(dtype)
        cache = buf[:, :, :capacity]
    else:
        cache = torch.randn(batch, n_kv, capacity, head_dim, device=device).to(dtype)
    for b, length in enumerate(lengths):
        cache[b, :, length:] = float("nan")
    return cache


def expected(q, k, v, cos, sin, k_cache, v_cache, lengths):
    """(q_out, k_cache, v_cache) as the spec makes them: ``rotary_reference`` in float32, then
    each sequence's new rows copied into a clone of the cache."""
    q_out, k_out = rotary_reference(q, k, cos, sin, upcast=True)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    n_new = k.shape[2]
    for b, start in enumerate(lengths):
        k_cache[b, :, start : start + n_new] = k_out[b]
        v_cache[b, :, start : start + n_new] = v[b]
    return q_out, k_cache, v_cache


def assert_matches(got, want, dtype):
    """q_out and k_cache within ``TOL`` (NaN where the spec has NaN), v_cache exactly."""
    rtol, atol = TOL[dtype]
    q_out, k_cache, v_cache = got
    torch.testing.assert_close(q_out, want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(k_cache, want[1], rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(v_cache, want[2], rtol=0, atol=0, equal_nan=True)


def run_case(batch, n_q, n_kv, n_new, capacity, head_dim, lengths, dtype, device,
             cache_layout="contiguous", qkv_layout="hf", lengths_dtype=torch.int64):  # fmt: skip
    q, k, v = projections(batch, n_q, n_kv, n_new, head_dim, dtype, device, qkv_layout)
    cos, sin = cos_sin(batch, n_new, head_dim, dtype, device)
    k_cache, v_cache = (
        old_cache(batch, n_kv, capacity, head_dim, lengths, dtype, device, cache_layout)
        for _ in "kv"
    )
    want = expected(q, k, v, cos, sin, k_cache, v_cache, lengths)
    seqlens = torch.tensor(lengths, dtype=lengths_dtype, device=device)
    inputs = [t.clone() for t in (q, k, v, cos, sin, seqlens)]
    q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, seqlens)
    assert q_out.shape == q.shape and q_out.dtype == dtype
    assert q_out.stride() == torch.empty_like(q).stride()  # rotary's layout
    assert_matches((q_out, k_cache, v_cache), want, dtype)
    for before, after in zip(inputs, (q, k, v, cos, sin, seqlens), strict=True):
        assert torch.equal(before, after), "an input was changed"


# --- the spec ------------------------------------------------------------------------------------

# (batch, q heads, kv heads, new tokens, capacity, head_dim, lengths, dtype, cache layout, q/k/v
# layout): GQA 2 and 4, a step of 1, 2, 5 and 16 tokens, lengths 0 and capacity - n_new, head_dim
# 6 (a 3-wide half, masked in a 4-wide tile), 16 and 64.
CASES = {
    "step1-gqa2-fp32": (3, 4, 2, 1, 20, 8, [0, 19, 7], torch.float32, "contiguous", "hf"),
    "step2-gqa4-bf16": (2, 4, 1, 2, 12, 16, [10, 3], torch.bfloat16, "token-major", "fused"),
    "step5-gqa2-fp16": (2, 4, 2, 5, 20, 6, [15, 0], torch.float16, "sliced", "hf"),
    "step16-gqa4-bf16": (2, 4, 1, 16, 24, 8, [8, 0], torch.bfloat16, "contiguous", "hf"),
    "step3-gqa2-fp32-d64": (1, 4, 2, 3, 7, 64, [4], torch.float32, "sliced", "contiguous"),
    "step4-gqa4-fp16-fused": (2, 4, 1, 4, 9, 8, [0, 5], torch.float16, "contiguous", "fused"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_rotary_reference_and_indexed_copy(case, device, poisoned_allocations):
    *sizes, cache_layout, qkv_layout = CASES[case]
    run_case(*sizes, device, cache_layout, qkv_layout)


@pytest.mark.parametrize("n_new", range(1, 17))
def test_every_step_length_up_to_16(n_new, device, poisoned_allocations):
    # one sequence at the cache's start, one ending at its last row
    capacity = 20
    run_case(2, 4, 2, n_new, capacity, 8, [0, capacity - n_new], torch.float32, device)


@pytest.mark.parametrize("lengths_dtype", [torch.int32, torch.int64], ids=str)
def test_lengths_int32_and_int64(lengths_dtype, device):
    run_case(2, 4, 2, 3, 10, 8, [4, 7], torch.bfloat16, device, lengths_dtype=lengths_dtype)


def test_one_length_expanded_as_transformers_keeps_it(device, poisoned_allocations):
    # StaticLayer.cumulative_length is a 0-d int64 tensor: expanded to (B,), stride 0
    q, k, v = projections(3, 4, 2, 2, 8, torch.float16, device)
    cos, sin = cos_sin(1, 2, 8, torch.float16, device)  # one row for every sequence
    k_cache, v_cache = (old_cache(3, 2, 12, 8, [5] * 3, torch.float16, device) for _ in "kv")
    want = expected(q, k, v, cos, sin, k_cache, v_cache, [5] * 3)
    length = torch.tensor(5, device=device)
    q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, length.expand(3))
    assert_matches((q_out, k_cache, v_cache), want, torch.float16)
    assert length.item() == 5  # not advanced: the caller's


def test_float32_cos_sin_with_bf16_q(device):
    q, k, v = projections(2, 4, 2, 3, 8, torch.bfloat16, device)
    cos, sin = cos_sin(2, 3, 8, torch.float32, device)
    k_cache, v_cache = (old_cache(2, 2, 6, 8, [0, 3], torch.bfloat16, device) for _ in "kv")
    want = expected(q, k, v, cos, sin, k_cache, v_cache, [0, 3])
    q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([0, 3]).to(device))
    assert q_out.dtype == torch.bfloat16
    assert_matches((q_out, k_cache, v_cache), want, torch.bfloat16)


def test_same_results_as_rotary(device):
    # The kernel shares rotary's head rotation: bit for bit its q and k (16-bit, any backend).
    q, k, v = projections(2, 4, 1, 3, 16, torch.bfloat16, device)
    cos, sin = cos_sin(2, 3, 16, torch.bfloat16, device)
    k_cache, v_cache = (old_cache(2, 1, 5, 16, [0, 0], torch.bfloat16, device) for _ in "kv")
    q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([0, 2]).to(device))
    q_rot, k_rot = rotary(q, k, cos, sin)
    assert torch.equal(q_out, q_rot)
    assert torch.equal(k_cache[0, :, :3], k_rot[0]) and torch.equal(k_cache[1, :, 2:], k_rot[1])


def test_head_loop_over_several_blocks_matches_one_block(monkeypatch, device):
    # 6 q heads and 3 kv heads in steps of one head, against all heads in one step.
    q, k, v = projections(2, 6, 3, 2, 8, torch.float32, device)
    cos, sin = cos_sin(2, 2, 8, torch.float32, device)
    seqlens = torch.tensor([1, 3], device=device)
    caches = [old_cache(2, 3, 6, 8, [1, 3], torch.float32, device) for _ in "kv"]
    caches += [c.clone() for c in caches]
    want_q = rotary_into_cache(q, k, v, cos, sin, *caches[:2], seqlens)
    monkeypatch.setattr(rotary_module, "TILE_ELEMENTS", 1)
    forget(cache_module.rotary_into_cache_op)  # a recorded replay would keep the one-step launch
    assert rotary_module.launch_config(6, 3, 8) == (1, 1, 4)
    got_q = rotary_into_cache(q, k, v, cos, sin, *caches[2:], seqlens)
    assert torch.equal(got_q, want_q)
    for got, want in zip(caches[2:], caches[:2], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_rows_outside_the_cache_are_not_written(monkeypatch, device, poisoned_allocations):
    # What a CUDA call does with lengths it cannot check: the kernel writes the rows inside
    # [0, capacity) and drops the others. (On CPU the value check is lifted to reach it.)
    if device == "cpu" and not cache_module.CPU_RUNS_TRITON:
        pytest.skip("on a CPU without TRITON_INTERPRET=1 the eager fallback runs, not the kernel")
    checks_without_values = functools.partial(cache_module.check_cache_inputs, values=False)
    monkeypatch.setattr(cache_module, "check_cache_inputs", checks_without_values)
    forget(cache_module.rotary_into_cache_op)
    q, k, v = projections(3, 4, 2, 3, 8, torch.float32, device)
    cos, sin = cos_sin(3, 3, 8, torch.float32, device)
    k_cache, v_cache = (old_cache(3, 2, 6, 8, [6, 6, 6], torch.float32, device) for _ in "kv")
    want_q, want_k, want_v = expected(q, k, v, cos, sin, k_cache, v_cache, [0, 0, 0])
    spec_k, spec_v = k_cache.clone(), v_cache.clone()
    spec_k[0, :, 0], spec_v[0, :, 0] = want_k[0, :, 2], want_v[0, :, 2]  # token 2 at row 0
    spec_k[1, :, 5], spec_v[1, :, 5] = want_k[1, :, 0], want_v[1, :, 0]  # token 0 at row 5
    seqlens = torch.tensor([-2, 5, 100], device=device)  # rows -2..0, 5..7, 100..102
    q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, seqlens)
    torch.testing.assert_close(q_out, want_q)  # q is rotated whatever the lengths
    torch.testing.assert_close(
        k_cache, spec_k, rtol=TOL[torch.float32][0], atol=TOL[torch.float32][1]
    )
    torch.testing.assert_close(v_cache, spec_v, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("batch", "n_new"), [(0, 3), (2, 0)], ids=["no_sequences", "no_new_tokens"]
)
def test_empty_inputs(batch, n_new, device):
    q, k, v = projections(batch, 4, 2, n_new, 8, torch.float32, device)
    cos, sin = cos_sin(batch, n_new, 8, torch.float32, device)
    k_cache, v_cache = (old_cache(batch, 2, 6, 8, [2] * batch, torch.float32, device)
                        for _ in "kv")  # fmt: skip
    before = (k_cache.clone(), v_cache.clone())
    seqlens = torch.full((batch,), 2, device=device)
    q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, seqlens)
    assert q_out.shape == q.shape
    for got, want in zip((k_cache, v_cache), before, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_plain_cpu_fallback_matches_the_kernel(monkeypatch):
    # Without TRITON_INTERPRET, CPU tensors take rotary_reference and indexed copies.
    q, k, v = projections(2, 4, 2, 3, 8, torch.float32, "cpu")
    cos, sin = cos_sin(2, 3, 8, torch.float32, "cpu")
    seqlens = torch.tensor([0, 5])
    caches = [old_cache(2, 2, 8, 8, [0, 5], torch.float32, "cpu") for _ in "kv"]
    caches += [c.clone() for c in caches]
    kernel_q = rotary_into_cache(q, k, v, cos, sin, *caches[:2], seqlens)
    monkeypatch.setattr(cache_module, "CPU_RUNS_TRITON", False)
    forget(cache_module.rotary_into_cache_op)
    fallback_q = rotary_into_cache(q, k, v, cos, sin, *caches[2:], seqlens)
    torch.testing.assert_close(fallback_q, kernel_q)
    for got, want in zip(caches[2:], caches[:2], strict=True):
        torch.testing.assert_close(got, want, equal_nan=True)


# --- the op by name, compile ---------------------------------------------------------------------


def small_args(device, dtype=torch.float32):
    q, k, v = projections(2, 4, 2, 3, 8, dtype, device)
    cos, sin = cos_sin(2, 3, 8, dtype, device)
    k_cache, v_cache = (old_cache(2, 2, 8, 8, [1, 5], dtype, device) for _ in "kv")
    return [q, k, v, cos, sin, k_cache, v_cache, torch.tensor([1, 5], device=device)]


def test_opcheck(device):
    # The schema's in-place annotations, the fake and the impl agree.
    args = small_args(device)
    for cache in args[5:7]:
        cache.nan_to_num_(0.0)  # opcheck compares the caches it mutates (NaN != NaN)
    torch.library.opcheck(op.default, args)


def test_meta_tensors_trace_the_op():
    args = [t.to("meta") for t in small_args("cpu")]
    q_out = op(*args)
    assert q_out.shape == args[0].shape and q_out.device.type == "meta"


def test_compiled_step_matches_eager(device):
    # Rotate and append, then read the cache: one fullgraph-compiled graph, compiled once for
    # two step lengths (the in-place op functionalized).
    def step(q, k, v, cos, sin, k_cache, v_cache, seqlens):
        q_out = rotary_into_cache(q, k, v, cos, sin, k_cache, v_cache, seqlens)
        return q_out * 2, k_cache.nan_to_num().sum()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for n_new in (3, 5):  # (not 2: the batch, which duck sizing would tie it to)
        q, k, v = projections(2, 4, 2, n_new, 8, torch.float32, device)
        cos, sin = cos_sin(2, n_new, 8, torch.float32, device)
        caches = [old_cache(2, 2, 12, 8, [1, 5], torch.float32, device) for _ in "kv"]
        caches += [c.clone() for c in caches]
        seqlens = torch.tensor([1, 5], device=device)
        got = compiled(q, k, v, cos, sin, *caches[:2], seqlens)
        want = step(q, k, v, cos, sin, *caches[2:], seqlens)
        torch.testing.assert_close(got, want)
        for got_cache, want_cache in zip(caches[:2], caches[2:], strict=True):
            torch.testing.assert_close(got_cache, want_cache, equal_nan=True)
    assert counter.frame_count == 1


# --- bad input -----------------------------------------------------------------------------------

NAMES = ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "cache_seqlens")


def bad_case(case: str) -> tuple[dict, type, str]:
    """(arguments, error type, message pattern) for one kind of bad input."""
    args = dict(zip(NAMES, small_args("cpu"), strict=True))
    k_cache, seqlens = args["k_cache"], args["cache_seqlens"]
    cases = {
        "q_not_a_tensor": ({"q": [1.0]}, TypeError, r"`q` must be a torch.Tensor, got list"),
        "v_none": ({"v": None}, TypeError, r"`v` must be a torch.Tensor, got NoneType"),
        "q_3d": ({"q": args["q"][0]}, ValueError, r"`q` must be 4-D"),
        "k_dtype": ({"k": args["k"].half()}, TypeError, r"`k` must have the dtype of `q`"),
        "v_dtype": (
            {"v": args["v"].double()},
            TypeError,
            r"`v` must have the dtype of `k` \(torch.float32\), got torch.float64",
        ),
        "k_cache_dtype": (
            {"k_cache": k_cache.half()},
            TypeError,
            r"`k_cache` must have the dtype of `k` \(torch.float32\), got torch.float16",
        ),
        "v_cache_dtype": (
            {"v_cache": args["v_cache"].to(torch.int8)},
            TypeError,
            r"`v_cache` must have the dtype of `k`",
        ),
        "seqlens_dtype": (
            {"cache_seqlens": seqlens.float()},
            TypeError,
            r"`cache_seqlens` must have dtype in \(int32, int64\), got torch.float32",
        ),
        "v_shape": ({"v": args["v"][:, :, :2]}, ValueError, r"`v` must have the shape of `k`"),
        "k_cache_heads": (
            {"k_cache": k_cache[:, :1]},
            ValueError,
            r"`k_cache` must be \(batch, kv_heads, capacity, head_dim\) with the batch, kv_heads "
            r"and head_dim of `k` \(2, 2, 3, 8\), got \(2, 1, 8, 8\)",
        ),
        "k_cache_head_dim": (
            {"k_cache": k_cache[..., :4]},
            ValueError,
            r"`k_cache` must be .*got \(2, 2, 8, 4\)",
        ),
        "k_cache_3d": ({"k_cache": k_cache[0]}, ValueError, r"`k_cache` must be \(batch, "),
        "v_cache_capacity": (
            {"v_cache": args["v_cache"][:, :, :7]},
            ValueError,
            r"`v_cache` must have the shape of `k_cache` \(\(2, 2, 8, 8\)\), got \(2, 2, 7, 8\)",
        ),
        "seqlens_shape": (
            {"cache_seqlens": torch.tensor([1, 5, 0])},
            ValueError,
            r"`cache_seqlens` must have shape \(2,\) \(one length per sequence\), got \(3,\)",
        ),
        "seqlens_0d": (
            {"cache_seqlens": torch.tensor(1)},
            ValueError,
            r"`cache_seqlens` must have shape \(2,\) .*got \(\)",
        ),
        "seqlens_too_long": (
            {"cache_seqlens": torch.tensor([1, 6])},
            ValueError,
            r"`cache_seqlens` must be between 0 and the capacity 8 less the 3 new tokens, got "
            r"values from 1 to 6",
        ),
        "seqlens_negative": (
            {"cache_seqlens": torch.tensor([-1, 0])},
            ValueError,
            r"`cache_seqlens` must be between 0 .*from -1 to 0",
        ),
        "k_cache_device": (
            {"k_cache": k_cache.to("meta")},
            ValueError,
            r"`k_cache` must be on the device of `q` \(cpu\), got meta",
        ),
        "seqlens_device": (
            {"cache_seqlens": seqlens.to("meta")},
            ValueError,
            r"`cache_seqlens` must be on the device of `q`",
        ),
    }
    changes, error, pattern = cases[case]
    return {**args, **changes}, error, pattern


BAD_CASES = [
    "q_not_a_tensor",
    "v_none",
    "q_3d",
    "k_dtype",
    "v_dtype",
    "k_cache_dtype",
    "v_cache_dtype",
    "seqlens_dtype",
    "v_shape",
    "k_cache_heads",
    "k_cache_head_dim",
    "k_cache_3d",
    "v_cache_capacity",
    "seqlens_shape",
    "seqlens_0d",
    "seqlens_too_long",
    "seqlens_negative",
    "k_cache_device",
    "seqlens_device",
]


def snapshot(args: dict) -> dict:
    return {
        name: t.clone()
        for name, t in args.items()
        if isinstance(t, torch.Tensor) and t.device.type != "meta"
    }


def assert_untouched(args: dict, before: dict) -> None:
    for name, t in before.items():
        torch.testing.assert_close(args[name], t, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_naming_the_argument(case):
    args, error, pattern = bad_case(case)
    before = snapshot(args)
    with pytest.raises(error, match=rf"^rotary_into_cache: {pattern}"):
        rotary_into_cache(**args)
    assert_untouched(args, before)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_a_gradient_is_refused(name):
    args = dict(zip(NAMES, small_args("cpu"), strict=True))
    args[name].requires_grad_()
    before = snapshot(args)
    with pytest.raises(RuntimeError, match=r"^rotary_into_cache is inference-only"):
        rotary_into_cache(**args)
    with pytest.raises(RuntimeError, match=r"llmsys_fused.rotary_into_cache is inference-only"):
        op(*args.values())  # by name: the Autograd kernel refuses
    assert_untouched(args, before)
    with torch.no_grad():  # no gradient wanted: fine
        q_out = rotary_into_cache(**args)
    want = expected(*list(before.values())[:-1], [1, 5])
    assert_matches((q_out, args["k_cache"], args["v_cache"]), want, torch.float32)
