"""`llmsys-bench memory` on the tiny model, its CPU peak measurement, and the snapshot parsing."""

import math
import pickle

import pytest
import torch

from llmsys.bench_harness import results
from llmsys.profiling import cli, e2e, memory
from llmsys.profiling.options import Variant

TINY = ["--device", "cpu", "--size", "tiny", "--attention", "sdpa", "--ffn", "eager"]
MiB = 2**20


def peaks(rows) -> dict:
    """(mode, checkpointing, context, dtype) -> peak bytes."""
    return {
        (r.mode, r.provider.endswith("+ckpt"), int(r.x.split("ctx=")[1].split()[0]), r.dtype):
        r.memory_gib * 2**30
        for r in rows
    }  # fmt: skip


def test_sweep_rows_and_what_holds_between_them(tmp_path, capsys):
    # Batch 16: at this size the activations (above all the (B, T, vocab) logits) outgrow the
    # optimizer step's temporaries, which set a train step's peak at batch 2 (the same with and
    # without checkpointing there).
    argv = ["memory", *TINY, "--context-length", "16", "32", "--batch-size", "16"]
    assert cli.main([*argv, "--dtype", "fp32", "--out", str(tmp_path)]) == 0
    rows = results.read_rows(tmp_path / "memory.csv")
    assert [(r.mode, r.provider, r.x) for r in rows] == [
        (mode, provider, f"tiny ctx={c} batch=16")
        for c in (16, 32)
        for mode, provider in [
            ("forward", "sdpa+eager"),
            ("train-step", "sdpa+eager"),
            ("train-step", "sdpa+eager+ckpt"),
        ]
    ]
    for row in rows:
        assert row.kernel == "transformer_lm/memory" and row.dtype == "fp32"
        assert row.p50 > 0 and math.isnan(row.p20) and "profiler memory events" in row.config
    peak = peaks(rows)
    for c in (16, 32):
        # a train step holds the gradients and the optimizer state, and keeps activations
        assert peak["train-step", False, c, "fp32"] > peak["forward", False, c, "fp32"]
        # recomputing each block in the backward frees its saved activations
        assert peak["train-step", True, c, "fp32"] < peak["train-step", False, c, "fp32"]
    for mode, ckpt in [("forward", False), ("train-step", False), ("train-step", True)]:
        assert peak[mode, ckpt, 32, "fp32"] > peak[mode, ckpt, 16, "fp32"]  # grows with context
    # the first train-step case is looked at closely: on CPU, its timeline alone
    assert (tmp_path / "memory.png").stat().st_size > 0
    assert not (tmp_path / "memory_snapshot.pickle").exists()
    assert "need CUDA" in capsys.readouterr().out


def test_bf16_autocast_forward_holds_more_than_fp32_on_a_logits_bound_model(tmp_path):
    # What holds on CPU at this size: autocast keeps the fp32 weights and adds bf16 copies, and
    # the loss upcasts the bf16 logits to fp32 while they are alive (in fp32 that cast is free),
    # so the bf16 forward's peak is higher. A train step's bf16 peak comes within a percent of
    # fp32's either way (smaller saved activations, bigger casts): no relation is asserted.
    argv = ["memory", *TINY, "--context-length", "32", "--batch-size", "4", "--mode", "forward"]
    cli.main([*argv, "--snapshot", "0", "--out", str(tmp_path)])
    peak = peaks(results.read_rows(tmp_path / "memory.csv"))
    assert set(peak) == {("forward", False, 32, "fp32"), ("forward", False, 32, "bf16")}
    assert peak["forward", False, 32, "bf16"] > peak["forward", False, 32, "fp32"]
    assert not (tmp_path / "memory.png").exists()  # --snapshot 0


@pytest.mark.parametrize("flag, provider", [("--checkpoint", "sdpa+eager+ckpt"),
                                            ("--no-checkpoint", "sdpa+eager")])  # fmt: skip
def test_checkpoint_switch_keeps_one_way(tmp_path, flag, provider):
    argv = ["memory", *TINY, "--context-length", "16", "--batch-size", "2", "--dtype", "fp32"]
    cli.main([*argv, "--mode", "train-step", flag, "--out", str(tmp_path)])
    assert [r.provider for r in results.read_rows(tmp_path / "memory.csv")] == [provider]


def test_cpu_peak_is_the_running_sum_of_profiler_memory_events():
    def step():
        a = torch.empty(2 * MiB, dtype=torch.uint8)
        b = torch.empty(3 * MiB, dtype=torch.uint8)  # peak: 5 MiB
        del a, b
        c = torch.empty(4 * MiB, dtype=torch.uint8)
        del c

    totals = memory.running_total(memory.profiled_deltas(step), start=7)
    assert max(totals) == 7 + 5 * MiB and totals[-1] == 7


def test_resident_bytes_counts_each_storage_once():
    runner = e2e.Runner(Variant(dtype="fp32"), "tiny", 16, 2, "train-step", "cpu")
    params = sum(p.numel() * 4 for p in runner.model.parameters())
    buffers = sum(b.numel() * 4 for b in runner.model.buffers())
    batch = 2 * 17 * 8  # tokens and targets share one (2, 17) int64 tensor
    assert memory.resident_bytes(runner) == params + buffers + batch
    runner.step()  # AdamW's state: exp_avg and exp_avg_sq per parameter, and a step count each
    steps = sum(s["step"].untyped_storage().nbytes() for s in runner.optimizer.state.values())
    assert memory.resident_bytes(runner) == 3 * params + buffers + batch + steps


def test_out_of_memory_is_recorded_and_the_sweep_goes_on(tmp_path, oom_at_context_16):
    argv = ["memory", *TINY, "--context-length", "16", "8", "--batch-size", "2"]
    cli.main([*argv, "--dtype", "fp32", "--mode", "forward", "--out", str(tmp_path)])
    rows = results.read_rows(tmp_path / "memory.csv")
    assert (rows[0].x, rows[0].config) == ("tiny ctx=16 batch=2", "OOM")
    assert math.isnan(rows[0].p50) and rows[0].memory_gib is None
    assert rows[1].x == "tiny ctx=8 batch=2" and rows[1].memory_gib > 0


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["memory", "--help"])
    assert exit_info.value.code == 0
    assert "--snapshot" in capsys.readouterr().out


# ---- the snapshot's parsing, on a synthetic snapshot in torch.cuda.memory._snapshot()'s format


def frame(filename, line=1, name="f"):
    return {"filename": filename, "line": line, "name": name}


TORCH_FRAME = frame(f"{memory.TORCH_DIR}/nn/modules/linear.py", 125, "forward")
USER_FRAME = frame("/home/me/model.py", 42, "forward")


BACKWARD_FRAMES = [
    frame("??", 0, "at::_ops::mm::call(at::Tensor const&, at::Tensor const&)"),
    frame("??", 0, "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"),
    frame("", 0, "torch::autograd::Engine::thread_main(std::shared_ptr<GraphTask> const&)"),
]


def synthetic_snapshot() -> dict:
    """Device 1 had 100 bytes (the weights) before the trace; the trace allocates a (100 B),
    b (300 B), frees a, allocates c (50 B); b and c are still there at the end. Sizes in the
    trace are requested sizes: the segments' requested_size counts as they do."""
    trace = [
        {"action": "alloc", "addr": 1000, "size": 100, "frames": [TORCH_FRAME, USER_FRAME]},
        {"action": "segment_alloc", "addr": 5000, "size": 4096, "frames": []},
        {"action": "alloc", "addr": 5000, "size": 300, "frames": BACKWARD_FRAMES},
        {"action": "free_requested", "addr": 1000, "size": 100, "frames": []},
        {"action": "free_completed", "addr": 1000, "size": 100, "frames": []},
        {"action": "alloc", "addr": 1000, "size": 50, "frames": [TORCH_FRAME]},
    ]
    segment = {"address": 0, "total_size": 4096, "blocks": [], "active_size": 0}
    return {
        "device_traces": [[], trace],
        "segments": [
            segment | {"device": 0, "allocated_size": 512, "requested_size": 64},
            segment | {"device": 1, "allocated_size": 512, "requested_size": 150},
            segment | {"device": 1, "allocated_size": 512, "requested_size": 300},
        ],
    }


def test_timeline_of_a_synthetic_snapshot():
    snapshot = synthetic_snapshot()
    assert memory.trace_deltas(snapshot, 1) == [100, 300, -100, 50]
    start = memory.requested_at_trace_start(snapshot, 1)
    assert start == 150 + 300 - 350 == 100
    totals = memory.running_total(memory.trace_deltas(snapshot, 1), start)
    assert totals == [100, 200, 500, 400, 450]
    assert memory.trace_deltas(snapshot, 0) == []
    assert memory.requested_at_trace_start(snapshot) == 64  # device 0's segment


def test_largest_allocations_say_where_they_were_made():
    snapshot = synthetic_snapshot()
    assert memory.largest_allocations(snapshot, 1, top=2) == [
        (300, "backward MmBackward0"),  # autograd's thread: no Python frame, the node instead
        (100, "/home/me/model.py:42 forward"),  # the torch frame inside it is skipped
    ]
    assert memory.largest_allocations(snapshot, 1, top=5)[-1] == (50, "(no frame outside torch)")
    site = memory.allocation_site([frame("<frozen runpy>"), frame("Module.cpp"), USER_FRAME])
    assert site == "/home/me/model.py:42 forward"


def test_plot_timeline_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = memory.plot_timeline([0, 2**30, 2**29], tmp_path / "t.png", "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
def test_cuda_snapshot_timeline_matches_the_allocator_peak(tmp_path, capsys):
    argv = ["memory", "--device", "cuda", "--size", "tiny", "--context-length", "64"]
    cli.main([*argv, "--dtype", "fp32", "--no-checkpoint", "--out", str(tmp_path)])
    rows = results.read_rows(tmp_path / "memory.csv")
    train = next(r for r in rows if r.mode == "train-step")
    snapshot = pickle.loads((tmp_path / "memory_snapshot.pickle").read_bytes())
    device = torch.cuda.current_device()
    totals = memory.running_total(
        memory.trace_deltas(snapshot, device), memory.requested_at_trace_start(snapshot, device)
    )
    # Another step of the same case: the same peak as the measured one, in requested bytes,
    # which the allocator rounds up to its blocks (a few percent more).
    blocks = train.memory_gib * 2**30
    assert 0.9 * blocks < max(totals) <= blocks
    assert min(totals) > 0 and (tmp_path / "memory.png").exists()
    out = capsys.readouterr().out
    assert "largest allocations" in out and "model.py" in out and "Backward" in out
