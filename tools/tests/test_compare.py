"""bench_compare on a synthetic pair of pytest-benchmark runs."""

import json
from pathlib import Path

import pytest

from llmsys_bench import compare


def write_run(path: Path, medians: dict[str, float]) -> Path:
    benchmarks = [{"fullname": name, "stats": {"median": m}} for name, m in medians.items()]
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    return path


@pytest.fixture
def baseline(tmp_path):
    return write_run(tmp_path / "base.json", {"fwd-ours": 1.0e-3, "fwd-eager": 2.0e-3})


def test_slower_median_fails(tmp_path, baseline, capsys):
    new = write_run(tmp_path / "new.json", {"fwd-ours": 1.2e-3, "fwd-eager": 2.0e-3})
    assert compare.main([str(new), str(baseline)]) == 1
    assert "REGRESSION: fwd-ours is 20.0% slower" in capsys.readouterr().out


def test_faster_or_equal_median_passes(tmp_path, baseline):
    new = write_run(tmp_path / "new.json", {"fwd-ours": 0.7e-3, "fwd-eager": 2.0e-3})
    assert compare.main([str(new), str(baseline)]) == 0


def test_within_threshold_passes_and_threshold_is_configurable(tmp_path, baseline):
    new = write_run(tmp_path / "new.json", {"fwd-ours": 1.09e-3, "fwd-eager": 2.0e-3})
    assert compare.main([str(new), str(baseline)]) == 0
    assert compare.main([str(new), str(baseline), "--threshold", "0.05"]) == 1


def test_new_and_missing_benchmarks_do_not_fail(tmp_path, baseline):
    new = write_run(tmp_path / "new.json", {"fwd-ours": 1.0e-3, "bwd-ours": 5.0e-3})
    results = {
        r.name: r.status(0.1)
        for r in compare.compare(compare.medians(new), compare.medians(baseline))
    }
    assert results == {"fwd-ours": "ok", "bwd-ours": "new", "fwd-eager": "missing"}
    assert compare.main([str(new), str(baseline)]) == 0


def test_missing_baseline_file_is_a_notice(tmp_path, capsys):
    new = write_run(tmp_path / "new.json", {"fwd-ours": 1.0e-3})
    assert compare.main([str(new), str(tmp_path / "h100.json")]) == 0
    assert "notice: no baseline" in capsys.readouterr().out
