"""define_op / wants_grad / call_below_autograd on a toy op wired as every kernel package wires
its ops: the direct call of the impl is taken only where the dispatcher would do nothing else,
and means the same as the op."""

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from llmsys.triton_launch import call_below_autograd, define_op, library, wants_grad
from llmsys.triton_launch.library import PythonEntry, _plain_call

impl_calls = []


def _double(x: torch.Tensor) -> torch.Tensor:
    impl_calls.append(x)
    with torch.no_grad():  # opaque to autograd, as a kernel launch is
        return x * 2


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return call_below_autograd(double_op, x)

    @staticmethod
    def backward(ctx, grad):
        return call_below_autograd(double_op, grad)


_lib = torch.library.Library("llmsys_test_library", "FRAGMENT")
double_op = define_op(_lib, "double(Tensor x) -> Tensor", _double, lambda x: torch.empty_like(x))
torch.library.register_autograd(
    double_op, lambda ctx, grad: call_below_autograd(double_op, grad), lib=_lib
)
refused_op = define_op(_lib, "refused(Tensor x) -> Tensor", _double, lambda x: torch.empty_like(x))


def _refuse(ctx, inputs, output):
    raise RuntimeError("refused: no grad")


torch.library.register_autograd(refused_op, lambda ctx, g: g, setup_context=_refuse, lib=_lib)


def double(x):
    """The public function of the one wiring."""
    if wants_grad(x):
        return _Double.apply(x)
    return call_below_autograd(double_op, x)


def refused(x):
    if wants_grad(x):
        raise RuntimeError("refused: no grad")
    return call_below_autograd(refused_op, x)


class _SeesOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _Subclass(torch.Tensor):
    pass


def _direct_call_ok(args: tuple) -> bool:
    """The impl may be called directly: the dispatcher, past autograd, would do nothing else."""
    return _plain_call(args) is not None


def test_plain_tensors_call_the_impl_directly():
    x = torch.randn(3, 4)
    assert _direct_call_ok((x, None, 3, 0.5, True))
    assert _direct_call_ok(())
    assert not _direct_call_ok((x, "a string"))  # anything but int/float/bool/None: the op


@pytest.fixture
def direct_calls(monkeypatch):
    """Who called the impl through library._impls: the names of the two calling functions, per
    call (the shortcut: ``below_autograd`` from ``call_below_autograd``; the dispatcher: the
    entry's ``__call__`` from the registered kernel)."""
    calls = []

    def recording(x):
        calls.append((sys._getframe(1).f_code.co_name, sys._getframe(2).f_code.co_name))
        return _double(x)

    monkeypatch.setitem(library._impls, double_op, PythonEntry(recording, double_op))
    return calls


def test_the_shortcut_is_taken_in_eager_mode_and_skipped_under_a_mode(direct_calls):
    x = torch.randn(4, requires_grad=True)
    double(x.detach())  # the public function runs the impl itself, not through the op
    assert direct_calls == [("below_autograd", "call_below_autograd")]
    torch.autograd.grad(double(x), x, torch.ones(4))  # the Function's forward and backward
    assert direct_calls[1:] == [("below_autograd", "call_below_autograd")] * 2
    with _SeesOps():
        double(x.detach())
    assert direct_calls[3:] == [("__call__", "kernel")]  # through the op


@pytest.mark.parametrize(
    "arg",
    [
        torch.randn(2, device="meta"),
        torch.randn(2, 2).to_sparse(),
        torch.randn(2).as_subclass(_Subclass),
    ],
    ids=["meta", "sparse", "subclass"],
)
def test_other_tensors_go_through_the_dispatcher(arg):
    assert not _direct_call_ok((torch.randn(2), arg))


def test_modes_transforms_tracing_and_the_profiler_go_through_the_dispatcher():
    x = torch.randn(2)
    with _SeesOps():
        assert not _direct_call_ok((x,))
    with TorchFunctionMode():
        assert not _direct_call_ok((x,))
    with torch.profiler.profile():
        assert not _direct_call_ok((x,))
    seen = []
    torch.func.vmap(lambda row: seen.append(_direct_call_ok((row,))) or row)(torch.randn(2, 3))
    assert seen == [False]
    torch.jit.trace(lambda t: seen.append(_direct_call_ok((t,))) or t * 1, x, check_trace=False)
    assert seen == [False, False]
    assert _direct_call_ok((x,))  # and back once they are gone


def test_direct_and_dispatched_calls_agree_with_the_formula():
    x = torch.randn(5, 3)
    impl_calls.clear()
    torch.testing.assert_close(double(x), x * 2, rtol=0, atol=0)
    assert len(impl_calls) == 1
    with _SeesOps() as mode:
        torch.testing.assert_close(double(x), x * 2, rtol=0, atol=0)
    assert "llmsys_test_library.double.default" in mode.ops  # the op itself, not only aten::mul
    with torch.profiler.profile() as prof:
        double(x)
    assert any(e.name == "llmsys_test_library::double" for e in prof.events())


@pytest.mark.parametrize("dispatched", [False, True], ids=["direct", "through a mode"])
def test_gradients_come_from_the_function_either_way(dispatched):
    x = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 2, dtype=torch.float64)
    mode = _SeesOps()
    with mode if dispatched else torch.enable_grad():
        out = double(x)
        (grad_x,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(grad_x, 2 * grad, rtol=0, atol=0)
    assert ("llmsys_test_library.double.default" in mode.ops) == dispatched
    with torch.no_grad():
        assert not double(x).requires_grad
    assert not double(x.detach()).requires_grad


def test_a_backward_that_builds_a_graph_goes_through_the_op():
    # create_graph=True: _Double.backward runs with grad on; its call must reach the op's
    # autograd (here _Double again), not the impl, or the second derivative would be lost.
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, dtype=torch.float64, requires_grad=True)
    (grad_x,) = torch.autograd.grad(double(x), x, v, create_graph=True)
    torch.testing.assert_close(grad_x, 2 * v, rtol=0, atol=0)
    (grad_v,) = torch.autograd.grad(grad_x.sum(), v)
    torch.testing.assert_close(grad_v, torch.full_like(v, 2.0), rtol=0, atol=0)


def test_below_autograd_the_call_skips_autograd_as_the_dispatcher_does():
    # As inside torch.library.custom_op's no-grad path: grad mode on, autograd switched off.
    x = torch.randn(3, requires_grad=True)
    with torch._C._AutoDispatchBelowAutograd():
        assert not double(x).requires_grad
        assert not double_op(x).requires_grad
        torch.testing.assert_close(refused(x), x.detach() * 2, rtol=0, atol=0)


def test_refused_gradients_raise_and_leave_inference_alone():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="refused: no grad"):
        refused(x)
    with pytest.raises(RuntimeError, match="refused: no grad"):
        refused_op(x)
    with torch.no_grad():
        torch.testing.assert_close(refused(x), x.detach() * 2, rtol=0, atol=0)


def test_an_op_not_made_by_define_op_is_named_in_the_error():
    with pytest.raises(ValueError, match=r"`op` must be an op made by define_op, got aten\.mul"):
        call_below_autograd(torch.ops.aten.mul.Tensor, torch.ones(2), torch.ones(2))


def test_the_public_function_compiles_as_the_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(6)
    compiled = torch.compile(lambda t: double(t) + 1, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), x * 2 + 1, rtol=0, atol=0)
    assert [node.target for node in graphs[0].graph.nodes if node.target is double_op]


def test_a_call_by_name_hands_the_impl_every_argument():
    """The dispatcher leaves trailing arguments at their defaults out of a Python kernel's call,
    where the native kernel gets them all: the impl sees them all either way, so a call by name
    has one recorded-plan signature from its first call on."""
    seen = []

    def scaled(x, bias, factor):  # no defaults of its own: the schema's must reach it
        seen.append((bias, factor))
        return x * factor if bias is None else x * factor + bias

    op = define_op(
        _lib,
        "scaled(Tensor x, Tensor? bias=None, int factor=3) -> Tensor",
        scaled,
        lambda x, bias=None, factor=3: torch.empty_like(x),
    )
    x = torch.randn(4)
    torch.testing.assert_close(op(x), x * 3)
    torch.testing.assert_close(op(x, None, 2), x * 2)
    assert seen == [(None, 3), (None, 2)]
