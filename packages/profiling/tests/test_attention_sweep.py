"""``llmsys-bench attention``: rows, correctness of every implementation, OOM handling, CLI."""

import argparse
import math
import sys

import pytest
import torch

from llmsys.bench_harness import results
from llmsys.profiling import attention_sweep, cli
from llmsys.profiling.attention import naive_attention
from llmsys.profiling.progress import progress

# One tiny shape shared by the tests, so torch.compile compiles it once per test session.
BATCH, SEQ, HEAD_DIM = 2, 24, 16
TINY = ["--device", "cpu", "--batch-size", str(BATCH), "--head-dim", str(HEAD_DIM)]
TINY += ["--seq-len", str(SEQ), "--passes", "2", "--warmup", "1"]


def causal_reference(q, k, v):
    """softmax(q k^T / sqrt(d), keys j <= i) v in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def test_sweep_writes_a_row_per_impl_mode_and_case(tmp_path):
    assert cli.main(["attention", *TINY, "--out", str(tmp_path)]) == 0
    rows = results.read_rows(tmp_path / "attention.csv")
    expected = {
        (impl, mode, f"d={HEAD_DIM} seq={SEQ}")
        for impl in attention_sweep.IMPLS
        for mode in ("forward", "backward")
    }
    assert {(r.provider, r.mode, r.x) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        assert r.kernel == "attention" and r.dtype == "fp32" and r.unit == "ms" and r.gpu == "cpu"
        assert 0 < r.p20 <= r.p50 <= r.p80
        assert r.throughput > 0 and r.throughput_unit == "TFLOP/s"
        assert r.memory_gib is None  # CUDA only
        assert r.speedup_vs_baseline > 0
        if r.provider == "naive":
            assert r.speedup_vs_baseline == pytest.approx(1.0)
    assert (tmp_path / "attention.png").stat().st_size > 0


@pytest.mark.parametrize("impl", attention_sweep.IMPLS)
def test_every_impl_matches_the_float64_causal_formula(impl):
    q, k, v = (torch.randn(BATCH, 1, SEQ, HEAD_DIM, requires_grad=True) for _ in range(3))
    dout = torch.randn(BATCH, 1, SEQ, HEAD_DIM)
    out = attention_sweep.attention_impl(impl)(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = causal_reference(q64, k64, v64)
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64), dout.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-4)


class _OutOfMemoryInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (injected)")


def _out_of_memory(q, k, v):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (injected)")


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_out_of_memory_impl_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, phase):
    def backward_oom(q, k, v):
        return _OutOfMemoryInBackward.apply(naive_attention(q, k, v))

    oom = _out_of_memory if phase == "forward" else backward_oom
    monkeypatch.setitem(attention_sweep.ATTENTION_FUNCTIONS, "sdpa", oom)
    argv = ["attention", *TINY, "--seq-len", "8", "16", "--impl", "sdpa", "naive"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    rows = {(r.provider, r.mode, r.x): r for r in results.read_rows(tmp_path / "attention.csv")}
    assert len(rows) == 8
    for seq in (8, 16):
        case = f"d={HEAD_DIM} seq={seq}"
        backward = rows["sdpa", "backward", case]
        assert backward.config == "OOM" and math.isnan(backward.p50)
        assert backward.speedup_vs_baseline is None
        forward = rows["sdpa", "forward", case]
        assert (forward.config == "OOM") == (phase == "forward")
        assert math.isnan(forward.p50) == (phase == "forward")
        for mode in ("forward", "backward"):  # the impl after the OOM one still ran
            assert rows["naive", mode, case].p50 > 0


def test_other_errors_propagate(tmp_path, monkeypatch):
    def broken(q, k, v):
        raise ValueError("not an OOM")

    monkeypatch.setitem(attention_sweep.ATTENTION_FUNCTIONS, "sdpa", broken)
    with pytest.raises(ValueError, match="not an OOM"):
        cli.main(["attention", *TINY, "--impl", "sdpa", "--out", str(tmp_path)])


def test_defaults_are_tiny_on_cpu_and_the_assignment_sweep_on_gpu():
    unset = dict(head_dim=None, seq_len=None, passes=None)
    cpu = argparse.Namespace(device="cpu", **unset)
    assert attention_sweep.resolve_defaults(cpu) == ([16], [16, 32], 2)
    gpu = argparse.Namespace(device="cuda", **unset)
    assert attention_sweep.resolve_defaults(gpu) == (
        [16, 32, 64, 128],
        [256, 1024, 4096, 8192, 16384],
        100,
    )
    chosen = argparse.Namespace(device="cpu", head_dim=[64], seq_len=[128], passes=5)
    assert attention_sweep.resolve_defaults(chosen) == ([64], [128], 5)


def test_causal_flops():
    # batch 1, seq 2, d 1: 3 visible pairs, 2 matmuls of 2 FLOPs per pair
    assert attention_sweep.causal_flops(1, 2, 1, "forward") == 12
    assert attention_sweep.causal_flops(1, 2, 1, "backward") == 30


def test_roofline_uses_the_precision_each_impl_multiplies_in(monkeypatch):
    assert attention_sweep.peak_flops("flash", "fp32", "cpu") == (None, "tf32")  # no peak on cpu
    monkeypatch.setattr(attention_sweep.results, "device_name", lambda d: "NVIDIA H100 80GB HBM3")
    assert attention_sweep.peak_flops("flash", "fp32", "cuda")[0] == pytest.approx(494.7e12)
    assert attention_sweep.peak_flops("sdpa", "bf16", "cuda")[0] == pytest.approx(989.4e12)
    # the others multiply fp32 in whatever precision PyTorch's setting picks (fp32 by default)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    peak, name = attention_sweep.peak_flops("naive", "fp32", "cuda")
    assert peak == pytest.approx(494.7e12 if tf32 else 66.9e12)
    assert ("tf32" if tf32 else "fp32") in name


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["attention", "--help"])
    assert exit_.value.code == 0
    assert "--head-dim" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--head-dim", "0"], "argument --head-dim: must be a positive integer, got '0'"),
        (["--seq-len", "-4"], "argument --seq-len: must be a positive integer, got '-4'"),
        (["--passes", "0"], "argument --passes: must be a positive integer"),
        (["--warmup", "-1"], "argument --warmup: must be a non-negative integer"),
        (["--impl", "cudnn"], "argument --impl: invalid choice: 'cudnn'"),
        (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["attention", "--device", "cpu", "--out", str(tmp_path), *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_progress_names_each_case_readably(monkeypatch, capsys):
    assert attention_sweep.case_label((16, 32, "naive")) == "naive d=16 seq=32"
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain one-line-per-case progress
    cases = [(16, 32, "naive"), (16, 32, "flash")]
    assert list(progress(cases, "attention", attention_sweep.case_label)) == cases
    err = capsys.readouterr().err
    assert "attention: 1/2 naive d=16 seq=32" in err and "(16, 32" not in err
