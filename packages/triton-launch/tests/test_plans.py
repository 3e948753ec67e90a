"""Recorded plans (plans.py, native_plans.cpp): a replayed call returns what the impl returns,
and a call the recorder cannot vouch for goes to the impl."""

import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from llmsys.triton_launch import (
    call_below_autograd,
    define_op,
    disabled,
    forget,
    launch,
    library,
    plans,
    runs_under_interpreter,
)
from llmsys.triton_launch import native as native_build
from llmsys.triton_launch.launcher import TensorDescriptor
from llmsys.triton_launch.plans import _NotReplayable, _Recording, _result, _source
from llmsys.triton_launch.testing import assert_replays


# alpha is a power of two in every test: x * alpha + 1 then rounds once, fused or not, so the
# kernel's results equal the eager formula's bit for bit.
@triton.jit
def affine(x_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * alpha + 1, mask=mask)


calls = []


def _affine(x: torch.Tensor, alpha: float) -> torch.Tensor:
    calls.append("affine")
    x = x.contiguous()  # a strided argument: one copy, a step of the plan
    out = torch.empty_like(x)
    launch(affine, triton.cdiv(x.numel(), 64), (x, out, x.numel(), alpha), {"BLOCK": 64})
    return out


def _two(x: torch.Tensor, y: torch.Tensor) -> tuple:
    """Two launches, a view returned, and a None."""
    calls.append("two")
    out = torch.empty(2, x.numel(), dtype=x.dtype, device=x.device)
    launch(affine, triton.cdiv(x.numel(), 64), (x, out[0], x.numel(), 2.0), {"BLOCK": 64})
    launch(
        affine, triton.cdiv(y.numel(), 64), (y[1:], out[1, 1:], y.numel() - 1, 4.0), {"BLOCK": 64}
    )
    return out[1].view(x.shape), None


def _zeros(x: torch.Tensor) -> torch.Tensor:
    calls.append("zeros")
    out = torch.zeros_like(x)  # a fill: not something a plan replays
    launch(affine, triton.cdiv(x.numel(), 64), (x, out, x.numel() // 2, 1.0), {"BLOCK": 64})
    return out


@triton.jit
def tile_add_one(in_desc, out_ptr, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = in + 1, read through a host tensor descriptor (TMA on Hopper)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile = in_desc.load([tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_N])
    tl.store(out_ptr + rows * n_cols + cols, tile + 1)


def _tiles(x: torch.Tensor) -> torch.Tensor:
    calls.append("tiles")
    out = torch.empty_like(x)
    descriptor = TensorDescriptor.from_tensor(x, [16, 32])
    grid = (x.shape[0] // 16, x.shape[1] // 32)
    launch(tile_add_one, grid, (descriptor, out, x.shape[1]), {"BLOCK_M": 16, "BLOCK_N": 32})
    return out


def _checked(x: torch.Tensor) -> torch.Tensor:
    calls.append("checked")
    if x.dim() != 1:
        raise ValueError(f"checked: `x` must be 1-D, got {x.dim()} dimensions")
    out = torch.empty_like(x)
    launch(affine, triton.cdiv(x.numel(), 64), (x, out, x.numel(), 1.0), {"BLOCK": 64})
    return out


_lib = torch.library.Library("llmsys_test_plans", "FRAGMENT")
affine_op = define_op(
    _lib, "affine(Tensor x, float alpha) -> Tensor", _affine, torch.empty_like, replays=True
)


def _affine_setup(ctx, inputs, output):
    ctx.alpha = inputs[1]


torch.library.register_autograd(
    affine_op, lambda ctx, grad: (grad * ctx.alpha, None), setup_context=_affine_setup, lib=_lib
)
two_op = define_op(
    _lib,
    "two(Tensor x, Tensor y) -> (Tensor, Tensor?)",
    _two,
    lambda x, y: (torch.empty_like(x), None),
)
zeros_op = define_op(_lib, "zeros(Tensor x) -> Tensor", _zeros, torch.empty_like)
tiles_op = define_op(_lib, "tiles(Tensor x) -> Tensor", _tiles, torch.empty_like)
checked_op = define_op(_lib, "checked(Tensor x) -> Tensor", _checked, torch.empty_like)


# --- on any machine: what the recorder accepts --------------------------------------------------


def test_the_recorder_lists_allocations_and_refuses_other_work():
    x = torch.randn(4, 6)
    with _Recording((x,)) as recording:
        out = torch.empty_like(x).view(24)
        x.t()
    assert recording.refused is None and len(recording.allocations) == 1
    assert recording.allocations[0].data_ptr() == out.data_ptr()
    for work in (torch.zeros_like, lambda t: t.clone(), lambda t: t.sum(), lambda t: t.item()):
        with _Recording((x,)) as recording:
            work(x[0, :1])
        assert recording.refused is not None


def test_copies_are_recorded_only_where_replay_copies_the_same_argument():
    x = torch.randn(6, 4).t()  # strided: .contiguous() copies
    with _Recording((x, 2.0)) as recording:
        x.contiguous()
    assert recording.refused is None and [step.position for step in recording.launches] == [0]
    with _Recording((x, x)) as recording:  # passed twice: which one a replay copies is unknown
        x.contiguous()
    assert recording.refused is not None
    y = torch.randn(4, 6)
    with _Recording((y,)) as recording:  # contiguous: a replay's .contiguous() is y itself
        y.clone(memory_format=torch.contiguous_format)
    assert recording.refused is not None


def test_pointers_map_to_one_argument_or_allocation():
    x, y, out = torch.randn(10), torch.randn(10), torch.empty(10)
    sources = [(1, 0, x), (1, 1, y), (2, 0, out)]
    assert _source(y.data_ptr(), sources) == (1, 1, 0)
    assert _source(out[3:].data_ptr(), sources) == (2, 0, 12)
    with pytest.raises(_NotReplayable):  # the same tensor twice: which one is ambiguous
        _source(x.data_ptr(), [(1, 0, x), (1, 1, x)])
    with pytest.raises(_NotReplayable):  # past every tensor
        _source(x.data_ptr() + 10_000_000, sources)


def test_the_kinds_of_a_compiled_signature():
    meta = SimpleNamespace(num_ctas=1, launch_cooperative_grid=False, launch_pdl=False)
    meta.__dict__.update(global_scratch_size=0, profile_scratch_size=0, shared=1024)
    meta.tensordesc_meta = None
    compiled = SimpleNamespace(metadata=meta, src=SimpleNamespace())
    compiled.src.signature = {"x": "*fp32", "n": "i32", "m": "i64", "f": "fp32", "B": "constexpr"}
    assert plans._kinds(compiled) == "pilf-"
    compiled.src.signature = {"x": "*fp32", "d": "tensordesc<fp16[64, 64]>"}
    assert plans._kinds(compiled) is None  # passed as pointers: Triton's launcher builds it
    meta.tensordesc_meta = [{}]
    assert plans._kinds(compiled) == "pT"  # lowered to TMA: a plan encodes its tensor map
    compiled.src.signature = {"x": "*fp32", "h": "fp16"}
    assert plans._kinds(compiled) is None
    compiled.src.signature = {"x": "*fp32"}
    meta.global_scratch_size = 128
    assert plans._kinds(compiled) is None


def test_results_map_to_allocations():
    out = torch.empty(2, 3)
    assert _result(out, [out]) == (1, ((0,),))
    assert _result((None, out[1]), [out]) == (2, (None, (0, (3,), (1,), 3)))
    assert _result(None, [out]) == (0, ())
    with pytest.raises(_NotReplayable):  # an argument returned
        _result(torch.empty(3), [out])


def test_a_recorder_failure_warns_and_keeps_the_impls_result(monkeypatch):
    def broken(recording, result):
        raise KeyError("a bug")

    monkeypatch.setattr(plans, "_plan", broken)
    x = torch.randn(3)
    with pytest.warns(RuntimeWarning, match="recording .* failed .*KeyError"):
        result, plan = plans.record(lambda t: torch.empty_like(t).copy_(t), (x,))
    assert plan == "the recorder failed (KeyError)" and torch.equal(result, x)


def test_cpu_calls_stay_with_the_impl():
    if not runs_under_interpreter(affine):
        pytest.skip("CPU tensors run Triton kernels only under TRITON_INTERPRET=1")
    x = torch.randn(100)
    calls.clear()
    for _ in range(4):
        torch.testing.assert_close(affine_op(x, 2.0), x * 2 + 1)
    assert calls == ["affine"] * 4
    assert type(library._impls[affine_op]) is library.PythonEntry


@pytest.fixture
def cpp_module():
    """native_plans, built (not initialized: no driver is needed) wherever torch's headers and a
    C++ compiler are, CI included, so a change that breaks the build fails here, not at a GPU
    user's first call."""
    if shutil.which("g++") is None and shutil.which("clang++") is None:
        pytest.skip("no C++ compiler on this machine")
    return native_build.load(native_build.build())


def test_the_cpp_module_builds_and_leaves_cpu_calls_to_the_impl(cpp_module):
    seen = []
    entry = cpp_module.Plans(lambda *args: seen.append(args) or "impl", affine_op, True)
    x = torch.randn(4)
    assert entry.replays and not cpp_module.Plans(None, affine_op).replays
    assert entry(x, 2.0) == "impl" and seen == [(x, 2.0)]
    report = entry.report()
    assert report["calls"] == 1 and report["replayed"] == 0 and report["planned"] == 0
    assert "init() was not called" in report["why_not"] or "off CUDA" in report["why_not"]
    with pytest.raises(ValueError, match="no replayable signature"):
        entry.install((x, 2.0), ((), (), (0, ())))


class _Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_the_cpp_thread_state_test_agrees_with_pythons(cpp_module):
    x, w = torch.randn(4), torch.randn(4, requires_grad=True)
    verdicts = []

    def both(args, state):
        verdicts.append((state, cpp_module.plain(args), library._plain_call(args)))

    both((x, 2.0, 3, True, None), "plain")
    both((x, w), "grad wanted")
    with torch.no_grad():
        both((x, w), "no_grad")
    with torch._C._AutoDispatchBelowAutograd():
        both((x, w), "below autograd")
    both((x, torch.nn.Parameter(torch.randn(4))), "a subclass")
    both((x, "text"), "a string")
    both((x.to_sparse(),), "sparse")
    with _Seen():
        both((x,), "a dispatch mode")
    with torch.device("cpu"):
        both((x,), "a function mode")
    torch.func.vmap(lambda row: both((row,), "vmap") or row)(torch.randn(2, 3))
    torch.jit.trace(lambda t: both((t,), "jit.trace") or t * 1, (x,))
    with torch.autograd.profiler.profile():
        both((x,), "profiler")
    direct = {"plain": False, "grad wanted": True, "no_grad": False, "below autograd": False}
    for state, cpp, python in verdicts:
        assert cpp == python, (state, cpp, python)
        if state != "jit.trace":  # (trace runs the function again, untraced, to check it)
            assert python == direct.get(state), (state, python)
    assert None in {python for state, _, python in verdicts if state == "jit.trace"}
    assert len({state for state, _, _ in verdicts}) == 12


def _kinds_impl(x, dims, mode, weight, scale=2.0):
    if mode == "bad":
        raise ValueError("kinds: `mode` must not be 'bad'")
    return x.sum(dims) * scale, None


_kinds_lib = torch.library.Library("llmsys_test_kernel", "DEF")
_kinds_lib.define(
    "kinds(Tensor x, int[] dims, str mode, Tensor? w, float s=2.0) -> (Tensor, Tensor?)"
)
_kinds_lib.impl("kinds", _kinds_impl, "CompositeExplicitAutograd")


def test_a_cpp_kernel_hands_every_argument_kind_to_the_impl_and_its_errors_back(cpp_module):
    # Plans.register_kernel makes an entry an op's kernel in C++ (CUDA in define_op; CPU here,
    # where a call without a plan takes the same path: arguments to Python, the impl, results
    # back by the schema).
    seen = []

    def impl(*args):
        seen.append(args)
        return _kinds_impl(*args)

    op = torch.ops.llmsys_test_kernel.kinds.default
    cpp_module.Plans(impl, op).register_kernel("llmsys_test_kernel::kinds", "CPU")
    x = torch.randn(2, 3)
    total, none = op(x, [1], "ok", None)
    torch.testing.assert_close(total, x.sum(1) * 2.0)
    assert none is None
    assert seen == [(x, [1], "ok", None, 2.0)]  # every argument, the default included
    with pytest.raises(ValueError, match="`mode` must not be 'bad'"):
        op(x, [0], "bad", x)
    assert "native_plans.Plans" in torch._C._dispatch_dump("llmsys_test_kernel::kinds")


def _triple(x):
    return x * 3


_autograd_lib = torch.library.Library("llmsys_test_autograd", "DEF")
_autograd_lib.define("triple(Tensor x) -> Tensor")
_autograd_lib.impl("triple", _triple, "CPU")
torch.library.register_autograd(
    "llmsys_test_autograd::triple", lambda ctx, grad: grad * 3, lib=_autograd_lib
)


def _python_calls(call) -> tuple:
    """``call()``'s result and the names of the Python functions it entered."""
    names = []
    sys.setprofile(lambda frame, event, arg: event == "call" and names.append(frame.f_code.co_name))
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return result, names


def test_the_cpp_autograd_kernel_skips_pythons_where_autograd_records_nothing(cpp_module):
    # register_autograd puts the C++ kernel in front of torch's Python autograd kernel (for CUDA
    # in define_op; CPU here): calls that record nothing skip it, the others reach the formula.
    op = torch.ops.llmsys_test_autograd.triple.default
    cpp_module.register_autograd("llmsys_test_autograd::triple", "AutogradCPU")
    assert "llmsys native_plans autograd" in torch._C._dispatch_dump("llmsys_test_autograd::triple")
    x = torch.randn(5)
    leaf = torch.randn(5, requires_grad=True)
    for grad_free in (lambda: op(x), lambda: torch.no_grad()(op)(leaf)):
        out, names = _python_calls(grad_free)
        assert "autograd_impl" not in names and "_triple" in names
        assert not out.requires_grad
    with torch._C._AutoDispatchBelowAutograd():
        assert not op(leaf).requires_grad
    torch.testing.assert_close(op(x), x * 3, rtol=0, atol=0)
    out, names = _python_calls(lambda: op(leaf))
    assert "autograd_impl" in names  # torch's kernel: the register_autograd formula
    v = torch.randn(5)
    (grad,) = torch.autograd.grad(out, leaf, v)
    torch.testing.assert_close(grad, v * 3, rtol=0, atol=0)
    torch.testing.assert_close(out, leaf.detach() * 3, rtol=0, atol=0)


# --- on a GPU: replay --------------------------------------------------------------------------


@pytest.fixture
def native():
    module = library.native_module()
    if module is None:
        pytest.skip("the native_plans module could not be built here (warned why)")
    return module


def _entry(op):
    entry = library._impls[op]
    assert type(entry).__name__ == "Plans", "the first CUDA call upgrades the entry"
    return entry


@pytest.mark.gpu
def test_the_third_call_records_a_plan_and_later_calls_replay_it(native):
    calls.clear()
    for i in range(6):
        x = torch.randn(1000 + 0 * i, device="cuda")
        out = call_below_autograd(affine_op, x, 0.5)
        torch.testing.assert_close(out, x * 0.5 + 1, rtol=0, atol=0)
    assert calls == ["affine"] * 3  # the first call, then two recordings
    assert _entry(affine_op).report()["planned"] >= 1
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(affine_op(x, 0.5), x * 0.5 + 1, rtol=0, atol=0)  # by name
    assert calls == ["affine"] * 3


@pytest.mark.gpu
def test_a_call_by_name_replays_in_the_cpp_cuda_kernel(native):
    x = torch.randn(301, device="cuda")
    torch.testing.assert_close(affine_op(x, 8.0), x * 8 + 1, rtol=0, atol=0)  # upgrades
    _entry(affine_op)
    assert "native_plans.Plans" in torch._C._dispatch_dump("llmsys_test_plans::affine")
    calls.clear()
    for _ in range(5):
        x = torch.randn(301, device="cuda")
        torch.testing.assert_close(affine_op(x, 8.0), x * 8 + 1, rtol=0, atol=0)
    assert calls == ["affine"] * 2  # the two recordings; then replays, with no Python
    calls.clear()
    for _ in range(5):  # a tuple with a None, through the schema's `Tensor?`
        x, y = torch.randn(2, 40, device="cuda"), torch.randn(80, device="cuda")
        out, none = two_op(x, y)
        assert none is None and out.shape == (2, 40)
        torch.testing.assert_close(out.view(-1)[1:], y[1:] * 4 + 1, rtol=0, atol=0)
    assert calls == ["two"] * 3
    with torch.profiler.profile() as prof:
        affine_op(x.view(-1), 8.0)
    assert any(e.name == "llmsys_test_plans::affine" for e in prof.events())


@pytest.mark.gpu
def test_the_impls_errors_reach_a_caller_by_name_unchanged(native):
    x = torch.randn(64, device="cuda")
    torch.testing.assert_close(checked_op(x), x + 1, rtol=0, atol=0)
    bad = torch.randn(8, 8, device="cuda")
    for _ in range(4):  # the first call, the two recordings, and after
        with pytest.raises(ValueError, match=r"`x` must be 1-D, got 2 dimensions"):
            checked_op(bad)
    torch.testing.assert_close(checked_op(x), x + 1, rtol=0, atol=0)


@pytest.mark.gpu
def test_each_signature_gets_its_own_plan(native):
    calls.clear()
    base = torch.randn(4097, device="cuda")
    cases = [(base[:4096], 2.0), (base[1:], 2.0), (base[:4096], -0.5), (base[:777], 2.0)]
    cases.append((base[::3], 0.25))  # strided: copied, then launched
    for _ in range(4):
        for x, alpha in cases:
            out = call_below_autograd(affine_op, x, alpha)
            torch.testing.assert_close(out, x * alpha + 1, rtol=0, atol=0)
    assert len(calls) == 3 * len(cases)


@pytest.mark.gpu
def test_views_tuples_and_none_are_replayed(native):
    calls.clear()
    for _ in range(5):
        x, y = torch.randn(3, 50, device="cuda"), torch.randn(150, device="cuda")
        out, none = call_below_autograd(two_op, x, y)
        assert none is None and out.shape == (3, 50)
        torch.testing.assert_close(out.view(-1)[1:], y[1:] * 4 + 1, rtol=0, atol=0)
    assert calls == ["two"] * 3


@pytest.mark.gpu
def test_tensor_descriptors_are_encoded_again_for_each_replay(native):
    if TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors")
    calls.clear()
    for _ in range(6):
        x = torch.randn(64, 96, device="cuda")
        torch.testing.assert_close(call_below_autograd(tiles_op, x), x + 1, rtol=0, atol=0)
    # Hopper lowers the descriptor to a tensor map, which the plan encodes for each new address;
    # elsewhere the kernel gets pointers and Triton's own launcher, which a plan does not replay.
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert calls == ["tiles"] * (3 if hopper else 6)


@pytest.mark.gpu
def test_an_impl_that_fills_or_aliases_is_never_replayed(native):
    calls.clear()
    for _ in range(5):
        x = torch.randn(256, device="cuda")
        out = call_below_autograd(zeros_op, x)
        torch.testing.assert_close(out[:128], x[:128] + 1, rtol=0, atol=0)
        assert (out[128:] == 0).all()
    assert calls == ["zeros"] * 5
    report = _entry(zeros_op).report()
    assert report["refused"] == 1
    assert report["why_not"] == "refused: the impl called aten.zeros_like.default"
    calls.clear()
    x = torch.randn(64, device="cuda")
    for _ in range(5):
        out, _ = call_below_autograd(two_op, x.view(1, 64), x)  # one tensor as both arguments
        torch.testing.assert_close(out[0, 1:], x[1:] * 4 + 1, rtol=0, atol=0)
    assert calls == ["two"] * 5


@pytest.mark.gpu
def test_modes_hooks_and_grad_take_the_python_path(native):
    x = torch.randn(500, device="cuda")
    for _ in range(4):
        call_below_autograd(affine_op, x, 4.0)
    calls.clear()
    seen = []
    triton.knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        torch.testing.assert_close(call_below_autograd(affine_op, x, 4.0), x * 4 + 1)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(seen.append)
    assert calls == ["affine"] and len(seen) == 1  # the profiler's hook saw the launch
    with torch.profiler.profile() as prof:
        call_below_autograd(affine_op, x, 4.0)
    assert any(e.name == "llmsys_test_plans::affine" for e in prof.events())


@pytest.mark.gpu
def test_a_plan_replays_into_a_cuda_graph(native):
    x = torch.randn(2048, device="cuda")
    for _ in range(4):
        call_below_autograd(affine_op, x, 0.5)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = call_below_autograd(affine_op, x, 0.5)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 0.5 + 1, rtol=0, atol=0)


@pytest.mark.gpu
def test_forget_and_disabled_decide_what_is_replayed(native):
    switch = {"alpha": 2.0}
    lib = torch.library.Library("llmsys_test_plans_state", "FRAGMENT")
    op = define_op(
        lib,
        "scaled(Tensor x) -> Tensor",
        lambda x: _affine(x, switch["alpha"]),  # reads a module switch, not an argument
        torch.empty_like,
    )
    x = torch.randn(300, device="cuda")
    for alpha in (2.0, 4.0, 2.0):
        switch["alpha"] = alpha
        forget(op)  # whoever swaps the switch forgets the plans recorded with the old one
        for _ in range(4):
            out = call_below_autograd(op, x)
            torch.testing.assert_close(out, x * alpha + 1, rtol=0, atol=0)
    assert _entry(op).report()["planned"] == 1
    forget(op)
    assert _entry(op).report()["planned"] == 0
    calls.clear()
    with disabled():
        for _ in range(4):
            call_below_autograd(op, x)
    assert calls == ["affine"] * 4 and _entry(op).report()["planned"] == 0
    assert _entry(op).report()["why_not"] == "replay is off (disabled())"


@pytest.mark.gpu
def test_a_full_table_makes_room_for_new_signatures(native):
    for n in range(1, 301):  # more signatures than a table holds
        x = torch.randn(n, device="cuda")
        for _ in range(4):
            out = call_below_autograd(affine_op, x, 0.5)
        torch.testing.assert_close(out, x * 0.5 + 1, rtol=0, atol=0)
    report = _entry(affine_op).report()
    assert 0 < report["planned"] <= 256
    assert report["planned"] + report["pending"] + report["refused"] <= 256


@pytest.mark.gpu
def test_malformed_plans_are_refused_with_the_reason(native):
    x = torch.randn(8, device="cuda")
    call_below_autograd(affine_op, x, 1.0)
    entry = _entry(affine_op)
    with pytest.raises(ValueError, match="malformed"):
        entry.install((x, 1.0), ((), ((0, (1, 1, 1), 32, 0, (("p", 1, 5, 0),)),), (0, ())))
    with pytest.raises(ValueError, match="no replayable signature"):
        entry.install((x.cpu(), 1.0), ((), (), (0, ())))


@pytest.mark.gpu
def test_assert_replays_passes_ops_that_replay_and_names_why_one_does_not(native):
    x = torch.randn(256, device="cuda")
    assert_replays(lambda: call_below_autograd(affine_op, x, 2.0))  # the op made replays=True
    assert_replays(lambda: (affine_op(x, 2.0), call_below_autograd(affine_op, x[1:], 4.0)))
    with pytest.raises(
        AssertionError,
        match=r"zeros.default: 1 of 1 calls not replayed: refused: "
        r"the impl called aten.zeros_like",
    ):
        assert_replays(lambda: call_below_autograd(zeros_op, x), zeros_op)
    with pytest.raises(AssertionError, match="reached no op made with replays=True"):
        assert_replays(lambda: call_below_autograd(zeros_op, x))
    with pytest.raises(AssertionError, match=r"affine.default: `call` did not call it"):
        assert_replays(lambda: call_below_autograd(zeros_op, x), affine_op)
    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(print)
    try:
        with pytest.raises(AssertionError, match=r"not replayed: Triton's launch hooks"):
            assert_replays(lambda: call_below_autograd(affine_op, x, 2.0))
    finally:
        hooks.remove(print)


@pytest.mark.gpu
def test_the_engine_off_gives_the_bits_of_a_replay(native):
    # One op per kind of plan step: a copy of a strided argument and a scalar that does not
    # round away (affine), two launches into views with a None (two), a TMA tensor map (tiles).
    # Each case names the elements its op writes (two's first output leaves one unwritten).
    base = torch.randn(3 * 4096, device="cuda")
    other = torch.randn(3, 300, device="cuda")  # (arguments that share memory are refused)
    whole = lambda t: t  # noqa: E731
    cases = [
        (affine_op, (base[::3], 0.3), whole),
        (two_op, (other, base[:900]), lambda t: t.flatten()[1:]),
    ]
    if TensorDescriptor is not None and torch.cuda.get_device_capability()[0] >= 9:
        cases.append((tiles_op, (base[: 64 * 96].view(64, 96),), whole))
    for op, args, written in cases:
        assert_replays(lambda op=op, args=args: call_below_autograd(op, *args), op)
        replayed = call_below_autograd(op, *args)
        with disabled():
            off = call_below_autograd(op, *args)
        for r, o in zip(*(x if type(x) is tuple else (x,) for x in (replayed, off)), strict=True):
            if r is None or o is None:
                assert r is o is None, op
                continue
            same_bits = torch.equal(written(r).view(torch.int32), written(o).view(torch.int32))
            assert same_bits, op


@pytest.mark.gpu
def test_the_op_by_name_replays_without_grad_and_differentiates_with_it(native):
    x = torch.randn(300, device="cuda")
    assert_replays(lambda: affine_op(x, 0.5), affine_op)  # past torch's Python autograd kernel
    dump = torch._C._dispatch_dump("llmsys_test_plans::affine")
    assert "llmsys native_plans autograd" in dump and "native_plans.Plans" in dump
    leaf = torch.randn(300, device="cuda", requires_grad=True)
    v = torch.randn(300, device="cuda")
    for _ in range(4):  # recorded and replayed below the formula, as without grad
        out = affine_op(leaf, 0.5)
        (grad,) = torch.autograd.grad(out, leaf, v)
        torch.testing.assert_close(out, leaf.detach() * 0.5 + 1, rtol=0, atol=0)
        torch.testing.assert_close(grad, v * 0.5, rtol=0, atol=0)
    with torch.no_grad():
        assert not affine_op(leaf, 0.5).requires_grad
