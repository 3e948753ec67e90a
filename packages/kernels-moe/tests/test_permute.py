"""Tests for padded_moe_permute: the issue's example, random routings against a loop spec, every
dispatch path, the out_rows path, gradients and every bad input.

On a CPU-only machine the Triton kernels run under Triton's interpreter (conftest.py). The permute
only copies, so results are compared exactly.
"""

import math

import pytest
import torch
from moe_helpers import permute_spec, rand, random_routing, set_switch

from llmsys.kernels_moe import ops, padded_moe_permute, padded_moe_permute_reference

# (num_tokens, hidden, topk, num_experts, align): primes and non-multiples of every block size,
# one token, topk == num_experts, align 1 (no padding) up to 128.
CASES = [
    (1, 1, 1, 1, 1),
    (13, 33, 2, 5, 8),
    (67, 17, 3, 7, 16),
    (29, 64, 4, 16, 32),
    (40, 8, 1, 3, 128),
    (7, 5, 8, 8, 1),
]
DTYPES = [torch.float32, torch.bfloat16]


def case_id(case) -> str:
    return "T{}-H{}-k{}-E{}-a{}".format(*case)


def bound(num_tokens, topk, num_experts, align) -> int:
    return num_tokens * topk + num_experts * (align - 1)


def permute(x, top, counts, align, **kwargs):
    return padded_moe_permute(
        x, top, counts, top.shape[1], counts.shape[0], align=align, return_row_index=True, **kwargs
    )


def assert_same(actual, expected) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape, (a.shape, e.shape)
        assert torch.equal(a.cpu().to(e.dtype), e.cpu()), (a, e)


# --- the issue's example -------------------------------------------------------------------------


def test_issue_example(device, poisoned_allocations):
    x = rand((4, 5), torch.float32, device)
    top = torch.tensor([[1, 3], [2, 5], [3, 5], [2, 4]], device=device)
    counts = torch.tensor([0, 1, 2, 2, 1, 2], device=device)
    out, padded, row_index = permute(x, top, counts, 128)
    assert padded.tolist() == [0, 128, 128, 128, 128, 128]
    assert out.shape == (640, 5)
    assert row_index.tolist() == [[0, 256], [128, 512], [257, 513], [129, 384]]
    expected = torch.zeros(640, 5, device=device)
    for row, token in [(0, 0), (128, 1), (129, 3), (256, 0), (257, 2), (384, 3), (512, 1)]:
        expected[row] = x[token]
    expected[513] = x[2]
    assert torch.equal(out, expected)


def test_issue_example_counts_128_1_129(device):
    top = torch.tensor([0] * 128 + [1] + [2] * 129, device=device)[:, None]  # (258, 1)
    counts = torch.tensor([128, 1, 129], device=device)
    x = rand((258, 3), torch.float32, device)
    out, padded, _ = permute(x, top, counts, 128)
    assert padded.tolist() == [128, 128, 256]
    assert out.shape == (512, 3)
    assert torch.equal(out[:128], x[:128]) and torch.equal(out[128], x[128])
    assert torch.equal(out[256:385], x[129:]) and not out[385:].any() and not out[129:256].any()


# --- random routings -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_loop_spec(case, dtype, device, poisoned_allocations):
    num_tokens, hidden, topk, num_experts, align = case
    x = rand((num_tokens, hidden), dtype, device)
    top, counts = random_routing(num_tokens, topk, num_experts, device)
    result = permute(x, top, counts, align)
    assert_same(result, permute_spec(x, top, counts, align))
    assert result[1].dtype == counts.dtype and result[2].dtype == torch.int32


@pytest.mark.parametrize("case", CASES[1:4], ids=case_id)
def test_reference_matches_loop_spec(case, device):
    num_tokens, hidden, topk, num_experts, align = case
    x = rand((num_tokens, hidden), torch.float32, device)
    top, counts = random_routing(num_tokens, topk, num_experts, device, skew=True)
    reference = padded_moe_permute_reference(
        x, top, counts, topk, num_experts, align=align, return_row_index=True
    )
    assert_same(reference, permute_spec(x, top, counts, align))


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int16, torch.uint8], ids=str)
def test_duplicate_experts_and_id_dtypes(id_dtype, device, poisoned_allocations):
    x = rand((23, 9), torch.float32, device)
    top, counts = random_routing(23, 4, 4, device, duplicates=True)
    assert (top[:, :, None] == top[:, None, :]).sum() > top.numel()  # some token repeats one
    result = permute(x, top.to(id_dtype), counts.to(torch.int32), 8)
    assert_same(result, permute_spec(x, top, counts, 8))


def test_experts_without_tokens_and_all_on_one(device, poisoned_allocations):
    x = rand((19, 7), torch.float32, device)
    top = torch.full((19, 1), 3, device=device)
    counts = torch.tensor([0, 0, 0, 19, 0], device=device)
    result = permute(x, top, counts, 16)
    assert result[1].tolist() == [0, 0, 0, 32, 0]
    assert_same(result, permute_spec(x, top, counts, 16))


@pytest.mark.parametrize("out_rows", [None, 0, 9])
def test_zero_tokens(out_rows, device):
    x = rand((0, 6), torch.float32, device)
    top = torch.zeros(0, 2, dtype=torch.int64, device=device)
    counts = torch.zeros(4, dtype=torch.int64, device=device)
    out, padded, row_index = permute(x, top, counts, 8, out_rows=out_rows)
    assert out.shape == (out_rows or 0, 6) and not out.any()
    assert padded.tolist() == [0, 0, 0, 0] and row_index.shape == (0, 2)


def test_zero_hidden(device):
    top, counts = random_routing(5, 2, 3, device)
    out, padded, row_index = permute(torch.empty(5, 0, device=device), top, counts, 4)
    assert out.shape == (int(padded.sum()), 0)
    assert_same(row_index[None], permute_spec(torch.empty(5, 0), top, counts, 4)[2][None])


def test_two_results_by_default(device):
    x = rand((3, 4), torch.float32, device)
    top, counts = random_routing(3, 1, 2, device)
    assert len(padded_moe_permute(x, top, counts, 1, 2)) == 2


def test_strided_rows_and_inputs_untouched(device):
    base = rand((31, 40), torch.float32, device)
    x = base[:, 3:30]  # row stride 40, 27 columns
    top, counts = random_routing(31, 3, 6, device)
    before = [t.clone() for t in (base, top, counts)]
    assert_same(permute(x, top, counts, 8), permute_spec(x, top, counts, 8))
    assert_same(permute(x.t().contiguous().t(), top, counts, 8), permute_spec(x, top, counts, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, (base, top, counts), strict=True))


# --- out_rows: a fixed output size, no host sync -------------------------------------------------


@pytest.mark.parametrize("case", CASES[1:4], ids=case_id)
def test_out_rows_pads_the_tail_with_zeros(case, device, poisoned_allocations):
    num_tokens, hidden, topk, num_experts, align = case
    x = rand((num_tokens, hidden), torch.float32, device)
    top, counts = random_routing(num_tokens, topk, num_experts, device, skew=True)
    rows = bound(num_tokens, topk, num_experts, align)
    result = permute(x, top, counts, align, out_rows=rows)
    assert_same(result, permute_spec(x, top, counts, align, out_rows=rows))
    exact = permute(x, top, counts, align)
    assert torch.equal(result[0][: exact[0].shape[0]], exact[0])


def test_out_rows_drops_what_it_cannot_place(device, poisoned_allocations):
    # Unchecked on this path: a bad id, a count below the histogram and a count above it.
    x = rand((6, 4), torch.float32, device)
    top = torch.tensor([[0], [9], [1], [1], [1], [2]], device=device)
    counts = torch.tensor([1, 2, 3], device=device)  # expert 1 has 3 pairs, expert 2 has 1
    out, padded, row_index = permute(x, top, counts, 2, out_rows=7)
    # rows: expert 0 [0, 2), expert 1 [2, 4), expert 2 [4, 8) cut at 7
    assert row_index[:, 0].tolist() == [0, -1, 2, 3, -1, 4]
    expected = torch.zeros(7, 4, device=device)
    expected[0], expected[2], expected[3], expected[4] = x[0], x[2], x[3], x[5]
    assert torch.equal(out, expected) and padded.tolist() == [2, 2, 4]


# --- dispatch paths ------------------------------------------------------------------------------


def forced_route(chunk, expert_tile, pairs_per_block, layout_tile):
    def config(n_pairs, num_experts):
        blocks = max(math.ceil(n_pairs / pairs_per_block), 1)
        return ops.RouteConfig(chunk, expert_tile, pairs_per_block, blocks, layout_tile)

    return config


ROUTES = {
    "one-block": forced_route(16, 2, 1 << 20, 2),
    "one-block-chunks": forced_route(16, 8, 1 << 20, 8),
    "blocks": forced_route(16, 8, 32, 4),
    "blocks-expert-tiles": forced_route(16, 2, 48, 2),
    "blocks-of-one-chunk": forced_route(16, 16, 16, 16),
}


@pytest.mark.parametrize("out_rows", [False, True], ids=["exact", "out_rows"])
@pytest.mark.parametrize("route", ROUTES, ids=str)
def test_every_route_path_gives_the_same_result(route, out_rows, device, monkeypatch):
    x = rand((45, 10), torch.float32, device)
    top, counts = random_routing(45, 3, 7, device, skew=True)
    kwargs = {"out_rows": bound(45, 3, 7, 8)} if out_rows else {}
    expected = permute_spec(x, top, counts, 8, **kwargs)
    set_switch(monkeypatch, "route_config", ROUTES[route])
    assert_same(permute(x, top, counts, 8, **kwargs), expected)


@pytest.mark.parametrize(("block_h", "zero_rows", "zero_h"), [(8, 4, 8), (16, 16, 4), (64, 1, 64)])
def test_every_copy_geometry_gives_the_same_result(block_h, zero_rows, zero_h, device, monkeypatch):
    x = rand((21, 37), torch.bfloat16, device)
    top, counts = random_routing(21, 2, 5, device)
    expected = permute_spec(x, top, counts, 16)
    set_switch(monkeypatch, "copy_config", lambda hidden, size: (block_h, 1))
    set_switch(monkeypatch, "zero_config", lambda hidden, size: (zero_rows, zero_h))
    assert_same(permute(x, top, counts, 16), expected)


def test_default_route_configs_cover_both_paths():
    assert ops.route_config(1024, 8).n_blocks == 1  # the issue's small case: one program
    big = ops.route_config(4096 * 8, 128)
    assert big.n_blocks > 1 and big.pairs_per_block * big.n_blocks >= 4096 * 8


def test_eager_fallback_matches_kernels(device, monkeypatch):
    x = rand((17, 6), torch.float32, "cpu")
    top, counts = random_routing(17, 2, 5, "cpu")
    kernels = permute(x, top, counts, 4)
    set_switch(monkeypatch, "CPU_RUNS_TRITON", False)
    assert_same(permute(x, top, counts, 4), kernels)
    assert_same(permute(x, top, counts, 4, out_rows=50), permute_spec(x, top, counts, 4, 50))


# --- gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize("out_rows", [None, 80])
def test_backward_sums_rows_back_to_tokens(out_rows, device, poisoned_allocations):
    x = rand((11, 6), torch.float32, device).requires_grad_()
    top, counts = random_routing(11, 3, 5, device, duplicates=True)
    out, _, row_index = permute(x, top, counts, 8, out_rows=out_rows)
    grad_out = rand(out.shape, torch.float32, device)
    (grad,) = torch.autograd.grad(out, x, grad_out)
    expected = grad_out[row_index.long()].sum(1)  # (T, k, H) -> (T, H)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-6)


def test_gradcheck_float64(device):
    x = rand((5, 3), torch.float64, device).requires_grad_()
    top, counts = random_routing(5, 2, 3, device, duplicates=True)
    assert torch.autograd.gradcheck(lambda x: permute(x, top, counts, 4)[0], (x,))


def test_compiles_fullgraph_with_out_rows(device):
    x = rand((9, 8), torch.float32, device)
    top, counts = random_routing(9, 2, 4, device)

    def f(x, top, counts):
        return padded_moe_permute(x, top, counts, 2, 4, align=4, out_rows=30)[0] * 2

    compiled = torch.compile(
        f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor"
    )
    torch.testing.assert_close(compiled(x, top, counts), f(x, top, counts))


# --- bad input -----------------------------------------------------------------------------------


def good_args(device):
    x = rand((6, 4), torch.float32, device)
    top, counts = random_routing(6, 2, 3, device)
    return {"x": x, "top_experts": top, "tokens_per_expert": counts, "topk": 2, "num_experts": 3}


I64 = torch.int64
BAD = {
    "x-not-tensor": ({"x": [[1.0]]}, TypeError, "`x`"),
    "x-integer": ({"x": torch.ones(6, 4, dtype=torch.int32)}, TypeError, "`x`"),
    "x-1d": ({"x": torch.ones(6)}, ValueError, "`x`"),
    "ids-float": ({"top_experts": torch.zeros(6, 2)}, TypeError, "`top_experts`"),
    "ids-rows": ({"top_experts": torch.zeros(5, 2, dtype=I64)}, ValueError, "`top_experts`"),
    "ids-columns": ({"topk": 1}, ValueError, "`top_experts`"),
    "topk-float": ({"topk": 2.0}, TypeError, "`topk`"),
    "topk-too-large": (
        {"topk": 4, "top_experts": torch.zeros(6, 4, dtype=I64)},
        ValueError,
        "`topk`",
    ),
    "experts-zero": ({"num_experts": 0}, ValueError, "`num_experts`"),
    "counts-length": (
        {"tokens_per_expert": torch.zeros(4, dtype=I64)},
        ValueError,
        "`tokens_per_expert`",
    ),
    "counts-float": ({"tokens_per_expert": torch.zeros(3)}, TypeError, "`tokens_per_expert`"),
    "align-zero": ({"align": 0}, ValueError, "`align`"),
    "out-rows-small": ({"out_rows": 11}, ValueError, "`out_rows`"),
    "out-rows-float": ({"out_rows": 20.0}, TypeError, "`out_rows`"),
    "device": (
        {"tokens_per_expert": torch.zeros(3, dtype=I64, device="meta")},
        ValueError,
        "device",
    ),
}


@pytest.mark.parametrize("bad", BAD, ids=str)
def test_bad_input_names_the_argument(bad, device):
    args = good_args(device)
    changes, error, match = BAD[bad]
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                 for k, v in changes.items()})  # fmt: skip
    with pytest.raises(error, match=match):
        padded_moe_permute(**args)


@pytest.mark.parametrize("bad_id", [3, -1, 1000])
def test_out_of_range_ids_are_rejected(bad_id, device):
    args = good_args(device)
    args["top_experts"][4, 1] = bad_id
    with pytest.raises(ValueError, match=rf"`top_experts`.*\[0, num_experts=3\).*{bad_id}"):
        padded_moe_permute(**args)


def test_counts_that_do_not_match_the_ids_are_rejected(device):
    args = good_args(device)
    args["tokens_per_expert"] = args["tokens_per_expert"] + torch.tensor([1, 0, -1], device=device)
    with pytest.raises(ValueError, match="`tokens_per_expert`"):
        padded_moe_permute(**args)


# --- GPU only ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_out_rows_path_never_syncs_and_captures_in_a_cuda_graph():
    x = rand((300, 256), torch.bfloat16, "cuda")
    top, counts = random_routing(300, 4, 16, "cuda")
    rows = bound(300, 4, 16, 128)
    permute(x, top, counts, 128, out_rows=rows)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, padded, row_index = permute(x, top, counts, 128, out_rows=rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same((out, padded, row_index), permute_spec(x.cpu(), top, counts, 128, out_rows=rows))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = permute(x, top, counts, 128, out_rows=rows)
    new_top, new_counts = random_routing(300, 4, 16, "cuda", skew=True)
    x.copy_(rand(x.shape, x.dtype, "cuda")), top.copy_(new_top), counts.copy_(new_counts)
    graph.replay()
    assert_same(captured, permute_spec(x.cpu(), top, counts, 128, out_rows=rows))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "hidden", "topk", "num_experts"),
    [(4096, 4096, 8, 128), (512, 2048, 2, 8), (1000, 7168, 8, 256)],
)
def test_benchmark_shapes_match_reference(num_tokens, hidden, topk, num_experts):
    x = rand((num_tokens, hidden), torch.bfloat16, "cuda")
    top, counts = random_routing(num_tokens, topk, num_experts, "cuda")
    expected = padded_moe_permute_reference(
        x, top, counts, topk, num_experts, return_row_index=True
    )
    assert_same(permute(x, top, counts, 128), expected)


@pytest.mark.gpu
def test_output_past_2_31_elements():
    x = rand((16384, 16384), torch.bfloat16, "cuda")
    top, counts = random_routing(16384, 8, 64, "cuda")
    out, padded, row_index = permute(x, top, counts, 128)
    assert out.numel() > 2**31
    tokens = torch.tensor([0, 1, 8191, 16383], device="cuda")
    for t in tokens.tolist():
        assert torch.equal(out[row_index[t].long()], x[t].expand(8, -1))
    last = int(padded.sum()) - 1  # the final row is data or padding: either way it was written
    assert torch.isfinite(out[last]).all()
