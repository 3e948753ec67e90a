"""Tests for the Triton FlashAttention-2: FlashAttention2Triton, flash_attention, the ops.

On a CPU-only machine the kernels run under Triton's interpreter (conftest.py) at small sizes,
where float32 dots are exact (tight tolerances); on a GPU they are TF32 and bigger cases run.
"""

import math

import pytest
import torch
from attn_helpers import (
    assert_matches_spec,
    check_assignment_case,
    make_qkv,
    reference_with_grads,
    relative_error,
    run_with_grads,
    set_switch,
    spy_on_launches,
)

from llmsys.flash_attn2 import FlashAttention2Triton, attention_reference, flash_attention, ops

CAUSAL = [False, True]
LENGTHS = [1, 7, 15, 17, 127, 129, 300]  # 300: four whole tiles of 64 and a ragged tail


def causal_id(causal: bool) -> str:
    return "causal" if causal else "full"


def attention_fn(causal, scale=None):
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, scale=scale)


def check_against_spec(q_shape, kv_shape, causal, dtype, device, scale=None, input_scale=1.0):
    q, k, v = make_qkv(q_shape, kv_shape, dtype, device, input_scale)
    grad_out = torch.randn(q_shape, device=device).to(dtype)
    got = run_with_grads(attention_fn(causal, scale), q, k, v, grad_out)
    ref_out, _, *ref_grads = reference_with_grads(q, k, v, grad_out, causal, scale)
    assert_matches_spec(got, (ref_out, *ref_grads), dtype, device)


# --- against the spec ----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
def test_assignment_case(causal, device, poisoned_allocations):
    # The CS336 assignment's check through `.apply(q, k, v, is_causal)`: batch 4, 128 queries and
    # keys, d 64, O, L, dQ, dK, dV within atol = rtol = 1e-2 (float32; TF32 dots on a GPU).
    check_assignment_case(FlashAttention2Triton, causal, device)


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
@pytest.mark.parametrize("n", LENGTHS)
def test_odd_lengths(n, causal, device, poisoned_allocations):
    check_against_spec((1, 2, n, 16), (1, 2, n, 16), causal, torch.float32, device)


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
@pytest.mark.parametrize(("n_q", "n_k"), [(5, 37), (37, 5), (64, 16), (16, 64), (1, 130)], ids=str)
def test_different_query_and_key_lengths(n_q, n_k, causal, device, poisoned_allocations):
    check_against_spec((2, 2, n_q, 16), (2, 2, n_k, 16), causal, torch.float32, device)


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (6, 1), (3, 3)], ids=str)
def test_grouped_query_attention(heads, kv_heads, causal, device, poisoned_allocations):
    check_against_spec((2, heads, 23, 16), (2, kv_heads, 29, 16), causal, torch.float32, device)


@pytest.mark.parametrize("head_dim", [1, 8, 16, 24, 32, 64, 80, 96, 128])
def test_head_dims(head_dim, device, poisoned_allocations):
    check_against_spec((1, 2, 19, head_dim), (1, 2, 19, head_dim), True, torch.float32, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
def test_low_precision(dtype, causal, device, poisoned_allocations):
    check_against_spec((2, 2, 45, 32), (2, 1, 45, 32), causal, dtype, device)


@pytest.mark.parametrize("input_scale", [3.0, 10.0])
def test_large_inputs_stay_finite_and_accurate(input_scale, device, poisoned_allocations):
    # Scores of hundreds: the online softmax must not overflow (flash-attention#334, #41). On a
    # GPU, float32 means TF32 dots whose rounding moves such scores by ~0.1: there the same
    # check runs in bfloat16 (exact products), test_gpu_large_inputs_bf16.
    if device == "cuda":
        pytest.skip("TF32 scores; covered by test_gpu_large_inputs_bf16")
    check_against_spec(
        (1, 2, 40, 32), (1, 2, 40, 32), True, torch.float32, device, None, input_scale
    )


@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
@pytest.mark.parametrize("scale", [0.7, -0.9, 0.0])
def test_explicit_scale(scale, causal, device, poisoned_allocations, monkeypatch):
    # 150 keys: unmasked tiles too, where a positive scale is folded into the exponent's FMA;
    # scores spread over hundreds, so a row max taken on the wrong side would overflow exp2.
    # Full-precision fp32 dots (not TF32) so that only the kernel's logic is under test.
    set_switch(monkeypatch, "DOT_PRECISION", "ieee")
    shape = (1, 1, 150, 16)
    check_against_spec(shape, shape, causal, torch.float32, device, scale, input_scale=3.0)


def test_three_dim_inputs_equal_one_head(device):
    q, k, v = make_qkv((2, 33, 16), (2, 33, 16), device=device)
    grad_out = torch.randn(2, 33, 16, device=device)
    three = run_with_grads(attention_fn(True), q, k, v, grad_out)
    four = run_with_grads(attention_fn(True), q[:, None], k[:, None], v[:, None], grad_out[:, None])
    assert all(torch.equal(a, b.squeeze(1)) for a, b in zip(three, four, strict=True))


# bfloat16: P = 1 exactly and the dots are exact, so the output is v exactly (float32 inputs
# would go through TF32 dots, which round v to 10 mantissa bits on a GPU).


def test_single_key_gives_that_value_row(device):
    q, k, v = make_qkv((1, 1, 9, 16), (1, 1, 1, 16), torch.bfloat16, device)
    out = flash_attention(q, k, v, causal=True)
    assert torch.equal(out, v.detach().expand(1, 1, 9, 16))


def test_causal_first_row_sees_only_the_first_key(device):
    q, k, v = make_qkv((1, 1, 3, 16), (1, 1, 5, 16), torch.bfloat16, device)  # top-left aligned
    out = flash_attention(q, k, v, causal=True)
    assert torch.equal(out[0, 0, 0], v.detach()[0, 0, 0])


# --- every dispatch path gives the same answer ---------------------------------------------------

SMALL_TILES = {
    "16x16": (ops.TileConfig(16, 16), ops.TileConfig(16, 16), ops.TileConfig(16, 16)),
    "32x16": (ops.TileConfig(32, 16), ops.TileConfig(16, 32), ops.TileConfig(32, 16)),
    "16x16, head-major": (
        ops.TileConfig(16, 16, head_major=True),
        ops.TileConfig(16, 16, head_major=True),
        ops.TileConfig(16, 16, head_major=True),
    ),
    "16x32": (ops.TileConfig(16, 32), ops.TileConfig(32, 16), ops.TileConfig(16, 32)),
}


@pytest.mark.parametrize("tiles", list(SMALL_TILES), ids=str)
@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
def test_tile_configs_agree(tiles, causal, device, monkeypatch, poisoned_allocations):
    # Several tiles per sequence: exercises the unmasked, diagonal and partial-tile loops.
    q, k, v = make_qkv((2, 2, 45, 16), (2, 1, 38, 16), device=device)
    grad_out = torch.randn(2, 2, 45, 16, device=device)
    default = run_with_grads(attention_fn(causal), q, k, v, grad_out)
    set_switch(monkeypatch, "tile_configs", lambda *args: SMALL_TILES[tiles])
    forced = run_with_grads(attention_fn(causal), q, k, v, grad_out)
    tol = 1e-5 if device == "cpu" else 5e-3  # the summation order differs; TF32 on a GPU
    for a, b in zip(forced, default, strict=True):
        assert relative_error(a, b) <= tol


def test_grid_takes_the_head_major_order_beyond_cudas_limit():
    head_major, head_minor = ops.TileConfig(64, 64, head_major=True), ops.TileConfig(64, 64)
    assert ops._grid(head_major, 16, 300) == (head_major, (4800,))
    assert ops._grid(head_minor, 16, 300) == (head_minor, (16, 300))
    assert ops._grid(head_minor, 3, 70000) == (head_major, (210000,))
    with pytest.raises(ValueError, match="more programs than a CUDA grid holds"):
        ops._grid(head_major, 2**16, 2**15)


def test_both_program_orders_give_identical_results(device, monkeypatch, poisoned_allocations):
    # Three 16-row tiles per head: the orders hand the same programs out in another sequence,
    # and each program's arithmetic is the same, so the results are bitwise equal.
    q, k, v = make_qkv((2, 2, 45, 16), (2, 1, 38, 16), device=device)
    grad_out = torch.randn(2, 2, 45, 16, device=device)

    def run(head_major: bool, max_grid_y: int = ops.MAX_GRID_Y):
        tiles = ops.TileConfig(16, 16, head_major=head_major)
        with monkeypatch.context() as patch:
            set_switch(patch, "tile_configs", lambda *args: (tiles, tiles, tiles))
            set_switch(patch, "MAX_GRID_Y", max_grid_y)
            return run_with_grads(attention_fn(True), q, k, v, grad_out)

    head_minor = run(False)
    forced = run(False, max_grid_y=2)  # 3 tiles are past this limit: head-major instead
    for results in (run(True), forced):
        assert all(torch.equal(a, b) for a, b in zip(results, head_minor, strict=True))


def test_cpu_fallback_matches_triton(monkeypatch):
    # Without TRITON_INTERPRET, CPU tensors run the plain-PyTorch FlashAttention-2.
    q, k, v = make_qkv((2, 4, 21, 16), (2, 2, 26, 16))
    grad_out = torch.randn(2, 4, 21, 16)
    triton_path = run_with_grads(attention_fn(True), q, k, v, grad_out)
    set_switch(monkeypatch, "CPU_RUNS_TRITON", False)
    fallback = run_with_grads(attention_fn(True), q, k, v, grad_out)
    for a, b in zip(fallback, triton_path, strict=True):
        assert relative_error(a, b) <= 1e-5


def test_backward_is_bitwise_deterministic(device):
    q, k, v = make_qkv((2, 4, 67, 32), (2, 2, 67, 32), torch.bfloat16, device)
    grad_out = torch.randn(2, 4, 67, 32, device=device).to(torch.bfloat16)
    first = run_with_grads(attention_fn(True), q, k, v, grad_out)
    second = run_with_grads(attention_fn(True), q, k, v, grad_out)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


# --- layouts, empty tensors, aliasing ------------------------------------------------------------


def test_strided_inputs_are_read_in_place(device, poisoned_allocations):
    # (B, N, H, d) projections viewed as (B, H, N, d), and a slice of a wider buffer.
    qkv = torch.randn(2, 29, 3, 4, 16, device=device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    grad_out = torch.randn(2, 4, 29, 16, device=device)
    strided = run_with_grads(attention_fn(True), q, k, v, grad_out)
    contiguous = run_with_grads(
        attention_fn(True), q.contiguous(), k.contiguous(), v.contiguous(), grad_out
    )
    assert all(torch.equal(a, b) for a, b in zip(strided, contiguous, strict=True))
    assert all(t.is_contiguous() for t in strided)


def test_expanded_grad_out(device):
    # out.sum().backward() hands the backward a stride-0 gradient.
    q, k, v = make_qkv((1, 2, 18, 16), (1, 2, 18, 16), device=device)
    flash_attention(q, k, v, causal=True).sum().backward()
    expected = run_with_grads(attention_fn(True), q, k, v, torch.ones(1, 2, 18, 16, device=device))
    assert all(
        torch.equal(a, b) for a, b in zip((q.grad, k.grad, v.grad), expected[1:], strict=False)
    )


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [
        ((0, 2, 5, 16), (0, 2, 5, 16)),
        ((1, 2, 0, 16), (1, 2, 5, 16)),
        ((1, 2, 5, 16), (1, 1, 0, 16)),
    ],
    ids=["batch0", "queries0", "keys0"],
)
def test_empty_tensors(q_shape, kv_shape, device, poisoned_allocations):
    q, k, v = make_qkv(q_shape, kv_shape, device=device)
    out = FlashAttention2Triton.apply(q, k, v, True)
    lse = out.grad_fn.saved_tensors[0]
    assert out.shape == q_shape and torch.equal(out, torch.zeros_like(out))
    assert lse.shape == q_shape[:-1] and bool((lse == float("-inf")).all())
    out.backward(torch.randn(q_shape, device=device))
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == kv_shape


def test_inputs_are_not_modified(device):
    q, k, v = make_qkv((1, 2, 33, 16), (1, 2, 33, 16), device=device)
    before = [t.detach().clone() for t in (q, k, v)]
    flash_attention(q, k, v, causal=True).sum().backward()
    assert all(torch.equal(t, c) for t, c in zip((q, k, v), before, strict=True))


def test_nan_poison_reaches_outputs(monkeypatch, device, poisoned_allocations):
    # Guards the fixture itself: with the kernel launch removed, the output must be all NaN.
    monkeypatch.setattr(ops, "launch", lambda *args, **kwargs: None)
    q, k, v = make_qkv((1, 1, 13, 16), (1, 1, 13, 16), device=device)
    assert torch.isnan(flash_attention(q, k, v)).all()


def test_every_change_of_problem_gives_the_spec(device):
    """A repeated problem (replayed on a GPU once recorded), then a change of shape, layout,
    head count, causal or the scale's sign: every output equals the reference."""
    q, k, v = (t.detach() for t in make_qkv((1, 2, 33, 16), (1, 2, 40, 16), device=device))
    problems = [
        *[(q, k, v, True, None)] * 4,  # recorded, then replayed on a GPU
        (q[:, :, :20], k, v, True, None),  # N_q
        (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True, None),  # q's strides
        (q, k[:, :1], v[:, :1], True, None),  # grouped-query heads
        (q, k, v, False, None),
        (q, k, v, True, -0.5),  # a negative scale is not folded
        (q[0], k[0], v[0], True, 0.3),  # 3-D
    ]
    for q_, k_, v_, causal, scale in problems:
        out = flash_attention(q_, k_, v_, causal=causal, scale=scale)
        expected, _ = attention_reference(q_, k_, v_, causal, scale, upcast=True)
        assert_matches_spec((out,), (expected,), q.dtype, device, names=("out",))


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [((1, 4, 33, 16), (1, 2, 33, 16)), ((2, 21, 16), (2, 40, 16))],
    ids=["gqa", "3-D"],
)
def test_a_repeated_backward_gives_the_spec_on_every_call(q_shape, kv_shape, device):
    """Fresh inputs five times per problem (recorded, then replayed on a GPU), the last with the
    stride-0 gradient of ``out.sum()``."""
    for call in range(5):
        q, k, v = make_qkv(q_shape, kv_shape, device=device)
        grad_out = torch.randn(q_shape, device=device)
        if call == 4:
            grad_out = torch.ones(1, device=device).expand(q_shape)
        got = run_with_grads(attention_fn(True), q, k, v, grad_out)
        ref_out, _, *ref_grads = reference_with_grads(q, k, v, grad_out, True)
        assert_matches_spec(got, (ref_out, *ref_grads), torch.float32, device)


@pytest.mark.parametrize("kernel", ["tma", "pointer"])
@pytest.mark.parametrize("causal", CAUSAL, ids=causal_id)
@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [
        ((1, 2, 33, 64), (1, 2, 70, 64)),
        ((1, 4, 130, 128), (1, 2, 130, 128)),
        ((2, 5, 32), (2, 9, 32)),
    ],
    ids=["d64-odd", "d128-gqa", "3-D"],
)
def test_each_forward_kernel_gives_the_spec(
    kernel, causal, q_shape, kv_shape, device, monkeypatch, poisoned_allocations
):
    """The TMA forward (tensor descriptors; the interpreter emulates the copy engine) and the
    pointer forward, each forced, on odd lengths, grouped-query heads and 3-D inputs."""
    set_switch(monkeypatch, "FORWARD_KERNEL", kernel)
    launched = spy_on_launches(monkeypatch)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v = (t.detach() for t in make_qkv(q_shape, kv_shape, dtype, device))
    out = flash_attention(q, k, v, causal=causal)
    expected, _ = attention_reference(q, k, v, causal, None, upcast=True)
    assert_matches_spec((out,), (expected,), dtype, device, names=("out",))
    kernels = ops.kernels
    expected_kernel = kernels.attn_fwd_tma_kernel if kernel == "tma" else kernels.attn_fwd_kernel
    assert [kernel for kernel, _ in launched] == [expected_kernel]


def test_a_switch_set_with_forget_reaches_the_kernels(device, monkeypatch):
    """A module switch the impl reads (the dot precision), set and followed by ``forget`` as
    ``set_switch`` does, reaches the launch of a problem that was already being replayed."""
    q, k, v = (t.detach() for t in make_qkv((1, 2, 16, 16), (1, 2, 16, 16), device=device))
    for _ in range(4):  # recorded, then replayed on a GPU
        flash_attention(q, k, v)
    launched = spy_on_launches(monkeypatch)
    set_switch(monkeypatch, "DOT_PRECISION", "ieee")
    flash_attention(q, k, v)
    assert [constexprs["DOT_PRECISION"] for _, constexprs in launched] == ["ieee"]


def test_a_repeated_forward_still_names_bad_arguments(device):
    q, k, v = (t.detach() for t in make_qkv((1, 2, 16, 16), (1, 2, 16, 16), device=device))
    for _ in range(4):  # recorded, then replayed on a GPU
        flash_attention(q, k, v, causal=True, scale=0.5)
    with pytest.raises(TypeError, match="`scale` must be a float"):
        flash_attention(q, k, v, scale=True)
    with pytest.raises(ValueError, match="`scale` must be finite"):
        flash_attention(q, k, v, causal=True, scale=math.inf)
    with pytest.raises(TypeError, match="`causal` must be a bool"):
        flash_attention(q, k, v, causal=1, scale=0.5)


def test_gqa_runs_no_expanding_op(device):
    # The recorded ops of a GQA forward and backward: ours only, nothing that copies k or v.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    q, k, v = make_qkv((1, 4, 16, 16), (1, 1, 16, 16), device=device)
    grad_out = torch.randn(1, 4, 16, 16, device=device)
    with Recorder() as recorder:
        flash_attention(q, k, v, causal=True).backward(grad_out)
    copies = {"aten.repeat_interleave", "aten.repeat", "aten.expand", "aten.clone", "aten.copy_"}
    assert "llmsys.flash_attn2_fwd" in recorder.ops and "llmsys.flash_attn2_bwd" in recorder.ops
    assert not recorder.ops & copies, recorder.ops


# --- torch.compile and opcheck -------------------------------------------------------------------


def test_compile_fullgraph_forward_and_backward(device):
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(attention_fn(True), fullgraph=True, backend=backend)
    q, k, v = make_qkv((1, 4, 21, 16), (1, 2, 21, 16), device=device)
    grad_out = torch.randn(1, 4, 21, 16, device=device)
    got = run_with_grads(compiled, q, k, v, grad_out)
    expected = run_with_grads(attention_fn(True), q, k, v, grad_out)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_opcheck(device):
    q, k, v = (t.detach() for t in make_qkv((1, 2, 9, 16), (1, 1, 9, 16), device=device))
    torch.library.opcheck(torch.ops.llmsys.flash_attn2_fwd.default, (q, k, v, True, 0.25))
    out, lse = torch.ops.llmsys.flash_attn2_fwd(q, k, v, True, 0.25)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(
        torch.ops.llmsys.flash_attn2_bwd.default, (grad_out, q, k, v, out, lse, True, 0.25)
    )


# --- bad input -----------------------------------------------------------------------------------


def good_args(**change):
    args = {
        "q": torch.randn(1, 4, 3, 8),
        "k": torch.randn(1, 2, 5, 8),
        "v": torch.randn(1, 2, 5, 8),
        "causal": False,
        "scale": None,
    }
    return args | change


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"q": [1.0]}, TypeError, r"`q` must be a torch.Tensor"),
        ({"v": None}, TypeError, r"`v` must be a torch.Tensor"),
        ({"k": torch.ones(1, 2, 5, 8, dtype=torch.int32)}, TypeError, r"`k` must have dtype in"),
        ({"q": torch.randn(1, 4, 3, 8, dtype=torch.float64)}, TypeError, r"`q` must have dtype"),
        ({"v": torch.randn(1, 2, 5, 8).half()}, TypeError, r"`v` must have the dtype of `q`"),
        ({"q": torch.randn(4, 3, 8, 1, 1)}, ValueError, r"`q` must be 3-D .* or 4-D"),
        ({"q": torch.randn(3, 8)}, ValueError, r"`q` must be 3-D .* or 4-D"),
        ({"k": torch.randn(2, 2, 5, 8)}, ValueError, r"`k` must be \(batch, kv_heads"),
        ({"k": torch.randn(1, 2, 5, 4)}, ValueError, r"`k` must be .* head_dim of `q`"),
        ({"k": torch.randn(2, 5, 8)}, ValueError, r"`k` must be"),
        ({"v": torch.randn(1, 2, 6, 8)}, ValueError, r"`v` must have the shape of `k`"),
        (
            {"k": torch.randn(1, 3, 5, 8), "v": torch.randn(1, 3, 5, 8)},
            ValueError,
            r"the 3 heads of `k` must divide the 4 heads of `q`",
        ),
        (
            {k: torch.randn(1, 1, 2, 257) for k in "qkv"},
            ValueError,
            r"`q` head_dim must be between 1 and 256, got 257",
        ),
        ({"k": torch.randn(1, 2, 5, 8, device="meta")}, ValueError, r"`k` must be on the device"),
        ({"causal": 1}, TypeError, r"`causal` must be a bool"),
        ({"scale": True}, TypeError, r"`scale` must be a float"),
        ({"scale": float("nan")}, ValueError, r"`scale` must be finite"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_inputs_raise(change, error, match):
    args = good_args(**change)
    before = {name: t.clone() for name, t in args.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(error, match=match):
        flash_attention(**args)
    assert all(torch.equal(args[name], t) for name, t in before.items() if t.device.type != "meta")


def test_apply_names_is_causal():
    with pytest.raises(TypeError, match=r"`is_causal` must be a bool"):
        FlashAttention2Triton.apply(*[torch.randn(1, 3, 8) for _ in range(3)], "no")


def test_bwd_op_names_bad_grad_out():
    q = k = v = torch.randn(1, 3, 8)
    out, lse = torch.ops.llmsys.flash_attn2_fwd(q, k, v, False, 1.0)
    with pytest.raises(ValueError, match=r"`grad_out` must have the shape of `out`"):
        torch.ops.llmsys.flash_attn2_bwd(torch.randn(1, 3, 9), q, k, v, out, lse, False, 1.0)


# --- GPU only: big and low-precision cases, memory ------------------------------------------------

GPU_CASES = [
    # (batch, heads, kv_heads, n_q, n_k, head_dim, causal, dtype)
    (4, 16, 16, 128, 128, 64, True, torch.bfloat16),
    (2, 8, 2, 1000, 1000, 64, True, torch.bfloat16),
    (2, 8, 2, 1000, 1000, 128, False, torch.bfloat16),
    (1, 4, 4, 1025, 777, 80, True, torch.float16),
    (1, 4, 1, 333, 1029, 96, False, torch.bfloat16),
    (1, 2, 2, 515, 515, 192, True, torch.bfloat16),
    (1, 2, 2, 300, 300, 256, True, torch.bfloat16),
    (1, 2, 2, 300, 300, 256, False, torch.float32),
    (1, 4, 2, 2048, 2048, 128, True, torch.float32),
    (1, 4, 2, 4097, 4097, 16, True, torch.bfloat16),
    (1, 4, 2, 4097, 4097, 32, True, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_cases_match_spec(case, poisoned_allocations):
    batch, heads, kv_heads, n_q, n_k, d, causal, dtype = case
    check_against_spec((batch, heads, n_q, d), (batch, kv_heads, n_k, d), causal, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("input_scale", [3.0, 10.0])
def test_gpu_large_inputs_bf16(input_scale):
    check_against_spec(
        (2, 4, 513, 64), (2, 4, 513, 64), True, torch.bfloat16, "cuda", None, input_scale
    )


@pytest.mark.gpu
def test_gpu_bf16_error_within_twice_eager():
    q, k, v = make_qkv((2, 8, 1024, 64), (2, 8, 1024, 64), torch.bfloat16, "cuda")
    grad_out = torch.randn(2, 8, 1024, 64, device="cuda").to(torch.bfloat16)
    ours = run_with_grads(attention_fn(True), q, k, v, grad_out)
    exact_out, _, *exact = reference_with_grads(q, k, v, grad_out, True)
    eager_out, _, *eager = reference_with_grads(q, k, v, grad_out, True, upcast=False)
    for got, bf16, want in zip(ours, (eager_out, *eager), (exact_out, *exact), strict=True):
        ours_error, eager_error = relative_error(got, want), relative_error(bf16, want)
        print(f"relative error: ours {ours_error:.2e}, eager bf16 {eager_error:.2e}")
        assert ours_error <= 2 * eager_error


@pytest.mark.gpu
def test_gpu_backward_is_bitwise_deterministic_at_scale():
    q, k, v = make_qkv((1, 16, 4096, 64), (1, 4, 4096, 64), torch.bfloat16, "cuda")
    grad_out = torch.randn(1, 16, 4096, 64, device="cuda").to(torch.bfloat16)
    runs = [run_with_grads(attention_fn(True), q, k, v, grad_out) for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.gpu
def test_gpu_gqa_backward_allocates_no_expanded_kv():
    # 32 query heads on 2 kv heads: an expanded k or v would be 16x its size.
    q, k, v = make_qkv((1, 32, 2048, 128), (1, 2, 2048, 128), torch.bfloat16, "cuda")
    grad_out = torch.randn_like(q)
    out = flash_attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out.backward(grad_out)
    torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (q, k, v))
    delta = q.numel() // q.shape[-1] * 4  # the fp32 D = rowsum(dO * O)
    expanded_kv = 2 * q.numel() * q.element_size()
    extra = torch.cuda.max_memory_allocated() - start - grads - delta
    assert extra < expanded_kv / 8, f"{extra} bytes beyond the gradients"


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements():
    # 2**31 + 2**20 elements per tensor (4 GiB each in bf16): 64-bit batch offsets. The last
    # batch entries, the ones past 2**31, are checked against the spec.
    shape = (2**31 // (128 * 128) + 64, 128, 128)
    q, k, v = make_qkv(shape, shape, torch.bfloat16, "cuda")
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = flash_attention(q, k, v, causal=True)
    out.backward(grad_out)
    tail = [t.detach()[-3:] for t in (q, k, v)]
    ref_out, _, *ref_grads = reference_with_grads(*tail, grad_out[-3:], True)
    got = (out.detach()[-3:], q.grad[-3:], k.grad[-3:], v.grad[-3:])
    assert_matches_spec(got, (ref_out, *ref_grads), torch.bfloat16, "cuda")


def test_double_backward_raises_instead_of_dropping_second_order_terms(device):
    q, k, v = (torch.randn(1, 2, 5, 16, device=device, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="flash_attention: double backward is not supported"):
        torch.autograd.grad(flash_attention(q, k, v).sum(), (q, k, v), create_graph=True)
    grads = torch.autograd.grad(flash_attention(q, k, v, causal=True).sum(), (q, k, v))
    assert all(g.shape == q.shape for g in grads)  # first order still works
