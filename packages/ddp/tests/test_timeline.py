"""The timeline breakdown's interval arithmetic, on a hand-made trace, and its CSV summary of a
run's JSON and top-ops tables."""

import csv
import io
import json
from pathlib import Path

from llmsys.bench_harness import load_beside

timeline = load_beside(Path(__file__).parents[1] / "benchmarks" / "timeline.py", "timeline")


def kernel(name, start, duration):
    return {"cat": "kernel", "name": name, "ts": start, "dur": duration}


def test_breakdown_separates_compute_nccl_overlap_and_idle():
    trace = {
        "traceEvents": [
            {"cat": "cpu_op", "ph": "X", "name": "aten::mm", "ts": 0, "dur": 500},
            {"cat": "cpu_op", "ph": "X", "name": "step end", "ts": 2500, "dur": 500},
            kernel("sm90_gemm", 1000, 2000),  # compute 1000-3000
            kernel("elementwise", 2500, 1000),  # compute to 3500 (overlaps the gemm)
            kernel("ncclDevKernel_AllReduce", 3000, 1500),  # nccl 3000-4500
            kernel("ncclDevKernel_AllReduce", 6000, 1000),  # nccl 6000-7000
            {"cat": "gpu_memcpy", "name": "Memcpy", "ts": 9000, "dur": 10},  # neither
        ]
    }
    parts = timeline.breakdown(trace)
    assert parts["span_ms"] == 7.0  # from the first CPU op (0) to the last kernel (7000 us)
    assert parts["host_issue_ms"] == 3.0
    assert parts["compute_busy_ms"] == 2.5
    assert parts["nccl_busy_ms"] == 2.5
    assert parts["overlap_ms"] == 0.5
    assert parts["gpu_idle_ms"] == 7.0 - 4.5  # covered: 1000-4500 and 6000-7000
    assert (parts["kernels"], parts["nccl_kernels"]) == (4, 2)


def test_merged_and_intersection():
    assert timeline.merged([(5, 6), (0, 2), (1, 3)]) == [[0, 3], [5, 6]]
    assert timeline.intersection([[0, 3], [5, 6]], [[2, 5.5]]) == 1.5
    assert timeline.intersection([], [[0, 1]]) == 0.0


TOP = """\
-----------------  ------------  ------------  ------------
             Name     CPU total  CPU time avg    # of Calls
-----------------  ------------  ------------  ------------
 c10d::allreduce_      48.549ms     166.835us           291
         aten::mm      39.790ms      55.035us           723
-----------------  ------------  ------------  ------------
"""


def test_profiler_row_reads_a_key_averages_table_by_header():
    assert timeline.profiler_row(TOP, "c10d::allreduce_")["CPU time avg"] == "166.835us"
    assert timeline.profiler_row(TOP, "aten::mm")["# of Calls"] == "723"
    assert timeline.profiler_row(TOP, "c10d::broadcast_") == {}


def test_summarize_writes_a_row_per_strategy_with_its_all_reduce_host_time(tmp_path, capsys):
    parts = {"step_ms": 10.0, "host_nosync_ms": 8.0, "gpu_idle_ms": 1.0, "kernels": 5,
             "nccl_kernels": 2}  # fmt: skip
    summary = {
        "gpu": "GPU", "torch": "2", "case": "xl ctx512 b4/rank", "world_size": 2,
        "timestamp": "2026-01-01", "strategies": {"ddp: torch DDP": parts, "fsdp: FSDP": parts},
    }  # fmt: skip
    (tmp_path / "timeline-b4.json").write_text(json.dumps(summary))
    (tmp_path / "top-ddp-torch_DDP-b4.txt").write_text(TOP)
    timeline.main(["--summarize", str(tmp_path / "timeline-b4.json")])
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["kind"], r["strategy"]) for r in rows] == [("ddp", "torch DDP"), ("fsdp", "FSDP")]
    assert (rows[0]["allreduce_calls"], rows[0]["allreduce_cpu_us"]) == ("291", "166.835")
    assert (rows[1]["allreduce_calls"], rows[1]["allreduce_cpu_us"]) == ("", "")  # no table
    assert rows[0]["step_ms"] == "10.0" and rows[0]["nccl_kernels"] == "2"
