"""Tests for ``decode_attention``: new queries against a static KV cache, split-KV (issue 46).

On a CPU-only machine the kernels run under Triton's interpreter (the root conftest) at tiny
sizes (capacity 64 at most, a chunk of 16 keys so that the combine pass meets several splits);
the GPU tests run a Llama-3.1-8B-like shape against SDPA and in a CUDA graph.
"""

import math
from pathlib import Path

import pytest
import torch
from attn_helpers import REL_TOL, relative_error
from decode_helpers import SMALL_CHUNK, decode_reference, make_cache, set_decode_switch

from llmsys.bench_harness import load_beside, read_rows
from llmsys.flash_attn2 import decode, decode_attention, ops, tuning
from llmsys.triton_launch import forget


def check_case(batch, heads, kv_heads, q_len, capacity, head_dim, lengths, dtype, device,
               layout="sliced", scale=None):  # fmt: skip
    q = torch.randn(batch, heads, q_len, head_dim, device=device).to(dtype)
    k_cache, v_cache = make_cache(
        batch, kv_heads, capacity, head_dim, lengths, dtype, device, layout
    )
    seqlens = torch.tensor(lengths, device=device, dtype=torch.int32)
    out = decode_attention(q, k_cache, v_cache, seqlens, sm_scale=scale)
    want = decode_reference(q, k_cache, v_cache, lengths, scale)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "non-finite output: garbage or an unwritten element leaked"
    tol = REL_TOL[(torch.device(device).type, dtype)]
    error = relative_error(out, want)
    assert error <= tol, f"relative error {error:.2e} > {tol:.0e}"
    return out


# (batch, heads, kv_heads, q_len, capacity, head_dim, lengths, dtype, layout): query lengths 1, 3
# and 16; GQA ratios 1, 4 and 8; each batch holds the shortest length (Q_LEN, so 1 when
# Q_LEN = 1), the full capacity and one in between that ends inside a chunk.
CASES = {
    "q1-mha-fp32": (3, 2, 2, 1, 64, 16, [1, 64, 37], torch.float32, "sliced"),
    "q1-gqa8-bf16": (2, 8, 1, 1, 48, 32, [48, 1], torch.bfloat16, "token-major"),
    "q3-gqa4-fp16": (3, 8, 2, 3, 64, 32, [3, 64, 18], torch.float16, "sliced"),
    "q3-mha-bf16-d24": (2, 2, 2, 3, 40, 24, [40, 3], torch.bfloat16, "contiguous"),
    "q16-gqa8-fp32": (2, 8, 1, 16, 64, 16, [16, 64], torch.float32, "token-major"),
    "q16-gqa4-bf16": (2, 4, 1, 16, 48, 16, [33, 16], torch.bfloat16, "sliced"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, device, monkeypatch, poisoned_allocations):
    set_decode_switch(monkeypatch, "CHUNK", SMALL_CHUNK)
    check_case(*CASES[case][:-1], device, layout=CASES[case][-1])


def test_default_chunk_one_split_and_explicit_scale(device, poisoned_allocations):
    # The default chunk (256) covers the whole tiny cache: one split, a trivial combine.
    check_case(2, 4, 2, 2, 40, 16, [40, 7], torch.float32, device, scale=-0.3)


def test_several_row_tiles(device, monkeypatch, poisoned_allocations):
    # GQA 4 x 16 queries = 64 rows; 16 rows per program: 4 row tiles per kv head.
    set_decode_switch(monkeypatch, "CHUNK", 32)
    set_decode_switch(monkeypatch, "MAX_BLOCK_M", 16)
    check_case(2, 8, 2, 16, 64, 16, [16, 50], torch.float32, device)


def test_int64_lengths_around_the_split_boundaries(device, monkeypatch):
    # One query against each length 1..capacity in one batch: the split boundaries at 16, 32.
    set_decode_switch(monkeypatch, "CHUNK", SMALL_CHUNK)
    lengths = [1, 15, 16, 17, 32, 33, 47]
    q = torch.randn(len(lengths), 2, 1, 16, device=device)
    k_cache, v_cache = make_cache(len(lengths), 2, 48, 16, lengths, torch.float32, device)
    out = decode_attention(q, k_cache, v_cache, torch.tensor(lengths, device=device))
    want = decode_reference(q, k_cache, v_cache, lengths)
    assert relative_error(out, want) <= REL_TOL[(torch.device(device).type, torch.float32)]


def test_cpu_fallback_matches_triton(monkeypatch):
    # Without TRITON_INTERPRET, CPU tensors take the plain-PyTorch masked softmax.
    set_decode_switch(monkeypatch, "CHUNK", SMALL_CHUNK)
    lengths = [3, 64, 20]
    q = torch.randn(3, 8, 3, 16)
    k_cache, v_cache = make_cache(3, 2, 64, 16, lengths, torch.float32, "cpu")
    seqlens = torch.tensor(lengths)
    triton_path = decode_attention(q, k_cache, v_cache, seqlens)
    monkeypatch.setattr(ops, "CPU_RUNS_TRITON", False)
    forget(decode.flash_attn2_decode)
    fallback = decode_attention(q, k_cache, v_cache, seqlens)
    assert torch.isfinite(fallback).all()
    assert relative_error(fallback, triton_path) <= 1e-5


def test_op_by_name_traces_and_refuses_grad():
    args = (torch.randn(2, 4, 1, 8), *torch.randn(2, 2, 2, 16, 8), torch.tensor([3, 16]), 0.5)
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in args]
    out = torch.ops.llmsys.flash_attn2_decode(*meta)
    assert out.shape == (2, 4, 1, 8) and out.device.type == "meta"
    q = args[0].requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        decode_attention(q, args[1], args[2], args[3])
    with pytest.raises(RuntimeError, match="inference-only"):
        torch.ops.llmsys.flash_attn2_decode(*args)
    with torch.no_grad():
        assert decode_attention(q, args[1], args[2], args[3]).shape == (2, 4, 1, 8)


def test_benchmark_script_runs_on_cpu(tmp_path):
    # benchmarks/decode.py --quick on CPU: one tiny grouped-query case with 4 new tokens, ours and
    # SDPA's math backend (given the bottom-right causal mask) against the float64 spec, in a CSV.
    script = Path(__file__).parents[1] / "benchmarks" / "decode.py"
    rows = load_beside(script, "decode").main(
        ["--device", "cpu", "--quick", "--out", str(tmp_path)]
    )
    written = read_rows(tmp_path / "decode_cpu.csv")
    assert [(r.provider, r.mode, r.x) for r in written] == [
        ("ours", "relative error vs float64 spec", "2x4x2x48x32 q4"),
        ("sdpa_math", "relative error vs float64 spec", "2x4x2x48x32 q4"),
        ("ours", "max abs difference vs sdpa_math", "2x4x2x48x32 q4"),
    ]
    assert [r.throughput for r in written] == pytest.approx([r.throughput for r in rows])
    ours, sdpa_math, difference = (r.throughput for r in written)
    assert 0 < ours < 1e-5 and 0 < sdpa_math < 1e-5 and difference < 1e-5  # float32


# --- bad input -----------------------------------------------------------------------------------


def good_args(**change):
    args = {
        "q": torch.randn(2, 4, 3, 8),
        "k_cache": torch.randn(2, 2, 16, 8),
        "v_cache": torch.randn(2, 2, 16, 8),
        "cache_seqlens": torch.tensor([3, 16], dtype=torch.int32),
        "sm_scale": None,
    }
    return args | change


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"q": [1.0]}, TypeError, r"`q` must be a torch.Tensor"),
        ({"cache_seqlens": [3, 16]}, TypeError, r"`cache_seqlens` must be a torch.Tensor"),
        ({"q": torch.randn(2, 4, 3, 8).double()}, TypeError, r"`q` must have dtype in"),
        ({"v_cache": torch.randn(2, 2, 16, 8).half()}, TypeError, r"`v_cache` must have the dtype"),
        ({"q": torch.randn(4, 3, 8)}, ValueError, r"`q` must be 4-D"),
        ({"k_cache": torch.randn(2, 16, 8)}, ValueError, r"`k_cache` must be \(batch, kv_heads"),
        ({"k_cache": torch.randn(3, 2, 16, 8)}, ValueError, r"`k_cache` must be .* batch"),
        ({"k_cache": torch.randn(2, 2, 16, 4)}, ValueError, r"`k_cache` must be .* head_dim"),
        ({"v_cache": torch.randn(2, 2, 15, 8)}, ValueError, r"`v_cache` must have the shape"),
        (
            {"k_cache": torch.randn(2, 3, 16, 8), "v_cache": torch.randn(2, 3, 16, 8)},
            ValueError,
            r"the 3 heads of `k_cache` must divide the 4 heads of `q`",
        ),
        ({"q": torch.randn(2, 4, 17, 8)}, ValueError, r"`q` must have 1 to 16 queries .* got 17"),
        ({"q": torch.randn(2, 4, 0, 8)}, ValueError, r"`q` must have 1 to 16 queries .* got 0"),
        (
            {"k_cache": torch.randn(2, 2, 2, 8), "v_cache": torch.randn(2, 2, 2, 8)},
            ValueError,
            r"`k_cache` must hold at least the 3 new tokens",
        ),
        (
            {"cache_seqlens": torch.tensor([3.0, 16.0])},
            TypeError,
            r"`cache_seqlens` must have dtype in \(int32, int64\)",
        ),
        (
            {"cache_seqlens": torch.tensor([[3, 16]])},
            ValueError,
            r"`cache_seqlens` must have shape \(2,\)",
        ),
        (
            {"cache_seqlens": torch.tensor([3, 16, 5])},
            ValueError,
            r"`cache_seqlens` must have shape \(2,\)",
        ),
        (
            {"cache_seqlens": torch.tensor([3, 16], device="meta")},
            ValueError,
            r"`cache_seqlens` must be on the device of `q`",
        ),
        (
            {"cache_seqlens": torch.tensor([2, 16])},
            ValueError,
            r"`cache_seqlens` must be between the 3 new tokens and the capacity 16, got .*2 to 16",
        ),
        ({"cache_seqlens": torch.tensor([3, 17])}, ValueError, r"`cache_seqlens` must be between"),
        ({"k_cache": torch.randn(2, 2, 16, 8, device="meta")}, ValueError, r"`k_cache` must be on"),
        ({"sm_scale": True}, TypeError, r"`sm_scale` must be a float"),
        ({"sm_scale": math.inf}, ValueError, r"`sm_scale` must be finite"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_inputs_raise(change, error, match):
    args = good_args(**change)
    before = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(error, match=match):
        decode_attention(**args)
    assert all(torch.equal(args[name], t) for name, t in before.items() if t.device.type != "meta")


# --- GPU only: a Llama-3.1-8B-like shape, CUDA graphs --------------------------------------------


def sdpa_decode(q, k_cache, v_cache, lengths):
    """SDPA per sequence over its valid keys, bottom-right causal via an explicit mask, float32."""
    outs = []
    q_len = q.shape[2]
    for b, length in enumerate(lengths):
        k, v = (t[b : b + 1, :, :length].float() for t in (k_cache, v_cache))
        rows = torch.arange(q_len, device=q.device)[:, None] + length - q_len
        mask = torch.arange(length, device=q.device)[None, :] <= rows
        out = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1].float(), k, v, attn_mask=mask, enable_gqa=True
        )
        outs.append(out)
    return torch.cat(outs).to(q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_gpu_cuda_graph_replays_with_new_lengths(q_len):
    batch, heads, kv_heads, capacity, head_dim = 4, 32, 8, 4096, 128
    dtype = torch.bfloat16
    q = torch.randn(batch, heads, q_len, head_dim, device="cuda", dtype=dtype)
    lengths = [q_len, 1000, 4096, 2500]
    k_cache, v_cache = make_cache(batch, kv_heads, capacity, head_dim, lengths, dtype, "cuda")
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_attention(q, k_cache, v_cache, seqlens)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, seqlens)
    for new_lengths in (lengths, [4096, q_len + 1, 17, 3333]):
        k_new, v_new = make_cache(batch, kv_heads, capacity, head_dim, new_lengths, dtype, "cuda")
        k_cache.copy_(k_new)
        v_cache.copy_(v_new)
        q.copy_(torch.randn_like(q))
        seqlens.copy_(torch.tensor(new_lengths, device="cuda", dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        eager = decode_attention(q, k_cache, v_cache, seqlens)
        assert torch.equal(out, eager), "the replay differs from an eager call"
        want = sdpa_decode(q, k_cache, v_cache, new_lengths)
        assert torch.isfinite(out).all()
        assert relative_error(out, want) <= REL_TOL[("cuda", dtype)]


@pytest.mark.gpu
def test_gpu_default_chunk_against_the_float64_spec():
    # The default chunk and tiles on the GPU, q_len 16, against the spec per sequence.
    lengths = [16, 777, 2048]
    check_case(3, 32, 8, 16, 2048, 128, lengths, torch.float16, "cuda")


def test_a_small_grid_takes_smaller_chunks():
    """The chunk halves, down to the key tile, until the grid has two programs per SM."""
    config = tuning.DecodeConfig(chunk=256, block_n=64)
    # batch 1, 8 kv heads, 1024 keys on 132 SMs: 4 splits x 8 = 32 programs -> chunk 64 (128)
    assert tuning.decode_chunk(config, 1024, 8, 132) == 64
    assert tuning.decode_chunk(config, 8192, 8, 132) == 128  # 64 x 8 = 512 >= 264
    assert tuning.decode_chunk(config, 1024, 8 * 32, 132) == 256  # batch 32: big enough
    assert tuning.decode_chunk(config, 100, 1, 132) == 64  # never below the key tile
    assert tuning.decode_chunk(config, 1024, 8, 1) == 256  # the interpreter's one "SM"
