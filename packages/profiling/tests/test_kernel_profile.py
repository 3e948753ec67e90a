"""`llmsys-bench profile` on the tiny model, and the attribution of kernels to profiler ranges."""

import json
import math
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Kernel

from llmsys.bench_harness import results
from llmsys.profiling import cli, kernel_profile

TINY = ["--device", "cpu", "--size", "tiny", "--context-length", "16", "--batch-size", "2"]
FAST = ["--dtype", "fp32", "--ffn", "eager", "--steps", "2", "--warmup", "1"]


def test_naive_attention_ranges_hold_their_ops_inside_forward(tmp_path, capsys):
    argv = ["profile", *TINY, *FAST, "--attention", "naive", "--top", "50"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    rows = results.read_rows(tmp_path / "profile.csv")
    assert {r.x for r in rows} == {"tiny ctx=16 batch=2 naive+eager"}
    assert {r.mode for r in rows} == {"profile"} and {r.dtype for r in rows} == {"fp32"}
    ops = {name: {r.kernel for r in rows if r.provider == name} for name in kernel_profile.RANGES}
    assert all(ops.values()), ops  # every range found some ops
    # q @ k^T (aten::matmul, which runs aten::bmm) is the scores range's, and it is in forward
    matmul = {"aten::matmul", "aten::bmm"}
    assert matmul <= ops["attention/scores"] and matmul <= ops["forward"]
    assert any("softmax" in op for op in ops["attention/softmax"])
    assert any("bmm" in op for op in ops["attention/weighted_sum"])
    assert "aten::bmm" in ops["backward"]  # the gradients of the attention matmuls
    # the optimizer's ops only in its range: AdamW's lerp_ of the first moment
    assert "aten::lerp_" in ops["optimizer_step"] and "aten::lerp_" not in ops["forward"]
    for row in rows:
        if row.kernel != "step":
            assert row.p20 <= row.p50 <= row.p80 and row.mean > 0
            assert row.config.startswith("calls/step=") and "share=" in row.config
    # shares in a range add up to 100% when every op is listed (--top 50 lists them all here)
    shares = [float(r.config.split("share=")[1].rstrip("%")) for r in rows
              if r.provider == "attention/softmax"]  # fmt: skip
    assert sum(shares) == pytest.approx(100, abs=0.2)
    wall, ops_row = [r for r in rows if r.kernel == "step"]
    assert wall.provider == "wall" and wall.p50 > 0 and wall.std >= 0
    assert ops_row.provider == "cpu-ops" and ops_row.p50 > 0 and math.isnan(ops_row.p20)
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer_step", "attention/scores"} <= names
    out = capsys.readouterr().out
    assert "attention/scores:" in out and "wrote" in out


def test_other_attention_has_no_attention_ranges_and_cases_get_their_own_trace(tmp_path):
    argv = ["profile", *TINY[:-4], "--context-length", "8", "16", "--batch-size", "2", *FAST]
    cli.main([*argv, "--attention", "sdpa", "--steps", "1", "--out", str(tmp_path)])
    rows = results.read_rows(tmp_path / "profile.csv")
    assert {r.provider for r in rows} == {"wall", "cpu-ops", *kernel_profile.PHASES}
    assert {r.x for r in rows} == {f"tiny ctx={c} batch=2 sdpa+eager" for c in (8, 16)}
    assert (tmp_path / "trace-1.json").exists() and (tmp_path / "trace-2.json").exists()


def fake_event(name, start, end, *, kernels=(), device=DeviceType.CPU, annotation=False):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        device_type=device,
        kernels=[Kernel(k, 0, us) for k, us in kernels],
        is_user_annotation=annotation,
        self_cpu_time_total=end - start,
    )


def test_kernels_go_to_the_range_their_launching_op_started_in():
    # What prof.events() holds on CUDA: the ranges (CPU annotations, and their GPU-side copies),
    # ops with the kernels they launched, one of them on autograd's thread in the backward.
    events = [
        fake_event("forward", 0, 10, annotation=True),
        fake_event("forward", 2, 30, device=DeviceType.CUDA, annotation=True),  # GPU side
        fake_event("attention/scores", 2, 4, annotation=True),
        fake_event("aten::mm", 1, 2, kernels=[("gemm_a", 5.0)]),
        fake_event("aten::bmm", 2.5, 3, kernels=[("gemm_b", 2.0), ("gemm_b", 2.0)]),
        fake_event("gemm_b", 3, 5, device=DeviceType.CUDA),  # the kernel's own event
        fake_event("backward", 10, 20, annotation=True),
        fake_event("aten::mm", 12, 13, kernels=[("gemm_a", 6.0)]),  # autograd's thread
        fake_event("forward", 20, 30, annotation=True),  # the next step
        fake_event("aten::mm", 21, 22, kernels=[("gemm_a", 4.0)]),
        fake_event("aten::add", 40, 41, kernels=[("add", 1.0)]),  # outside every range
    ]
    found = kernel_profile.attribute(events, device_kernels=True)
    assert found == {
        "forward": {"gemm_a": [5.0, 4.0], "gemm_b": [2.0, 2.0]},
        "backward": {"gemm_a": [6.0]},
        "attention/scores": {"gemm_b": [2.0, 2.0]},
    }
    # on CPU: each op's self time, the ranges and other annotations left out
    events.append(fake_event("Optimizer.step#AdamW.step", 5, 6, annotation=True))
    found = kernel_profile.attribute(events, device_kernels=False)
    assert found["forward"] == {"aten::mm": [1, 1], "aten::bmm": [0.5]}


def test_short_names_keep_what_tells_kernels_apart():
    lam = "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}"
    copy = f"void at::native::elementwise_kernel<128, 4, {lam}>(int, {lam} const&)"
    assert kernel_profile.short_name(copy, kernel=True) == (
        "elementwise_kernel<128, 4, direct_copy_kernel_cuda::{lambda#3}>"
    )
    softmax = "void (anonymous namespace)::softmax_warp_forward<float, 9>(float*, int)"
    assert kernel_profile.short_name(softmax, kernel=True) == "softmax_warp_forward<float, 9>"
    assert kernel_profile.short_name("aten::mm", kernel=False) == "aten::mm"
    assert len(kernel_profile.short_name("k<" + "x" * 200 + ">", kernel=True)) == 80


def test_out_of_memory_is_recorded_and_the_sweep_goes_on(tmp_path, oom_at_context_16):
    argv = ["profile", *TINY[:-4], "--context-length", "16", "8", "--batch-size", "2", *FAST]
    cli.main([*argv, "--attention", "sdpa", "--out", str(tmp_path)])
    rows = results.read_rows(tmp_path / "profile.csv")
    oom = [r for r in rows if "ctx=16" in r.x]
    assert [(r.kernel, r.config) for r in oom] == [("step", "OOM")] and math.isnan(oom[0].p50)
    assert any("ctx=8" in r.x and r.provider == "forward" for r in rows)


def test_nvtx_needs_cuda_and_is_skipped_on_cpu(tmp_path, capsys):
    argv = ["profile", *TINY, *FAST, "--attention", "sdpa", "--nvtx", "--steps", "1"]
    cli.main([*argv, "--out", str(tmp_path)])
    assert "NVTX ranges need CUDA" in capsys.readouterr().out


def test_help_and_bad_numbers(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", "--help"])
    assert exit_info.value.code == 0 and "--nvtx" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", *TINY, "--steps", "0", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "argument --steps: must be a positive integer, got '0'" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_kernels_land_in_their_ranges(tmp_path):
    argv = ["profile", "--device", "cuda", "--size", "tiny", "--context-length", "64"]
    cli.main([*argv, "--attention", "naive", "--ffn", "eager", "--top", "50",
              "--out", str(tmp_path)])  # fmt: skip
    rows = results.read_rows(tmp_path / "profile.csv")
    kernels = {name: {r.kernel for r in rows if r.provider == name}
               for name in kernel_profile.RANGES}  # fmt: skip
    assert all(kernels.values()), kernels
    top_scores = max((r for r in rows if r.provider == "attention/scores"), key=lambda r: r.mean)
    assert top_scores.kernel in kernels["forward"]
    assert any("gemm" in k or "sm90" in k or "cutlass" in k for k in kernels["backward"])
    busy = next(r for r in rows if r.provider == "gpu")
    wall = next(r for r in rows if r.provider == "wall")
    assert 0 < busy.p50 < wall.mean  # kernel time fits in the step
