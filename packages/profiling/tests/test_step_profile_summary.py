"""``llama_step_profile.py --summarize``: a report it printed, saved to a file, read back as CSV
rows (its steps and categories, or with ``--kernels`` the kernels it lists)."""

import csv
import io
from pathlib import Path

from llmsys.bench_harness import load_beside

profile = load_beside(
    Path(__file__).parents[1] / "benchmarks" / "llama_step_profile.py", "llama_step_profile"
)

# today's format, then the older one of the training reports (no graph time, no kernel count)
REPORT = """\
(a note added to the file)
0.85b decode batch 1, fp16, compiled layers: step 14.49 ms (CUDA events); as a CUDA graph 1.71 ms; \
GPU kernel time 1.45 ms/step in 362 kernels, idle 13.03 ms
  gemm (cuBLAS/CUTLASS, our W8A8)   0.992 ms    6.8%
  attention                  0.234 ms    1.6%
top kernels:
    0.568 ms    64/step  nvjet_sm90_hsh_64x8_64x16_4x1_v_bz_TNT
    0.112 ms    16/step  cudnn_generated_fort_native_sdpa_sm90_flash_fprop_kernel0_0
llmsys compiled: step 100.0 ms (CUDA events), GPU kernel time 92.9 ms/step, idle 7.0 ms
  optimizer                   9.19 ms    9.2%
top kernels:
     5.42 ms    16/step  attn_bwd_dkdv_kernel
"""


def _csv(tmp_path, capsys, *options) -> list[dict]:
    (tmp_path / "report.txt").write_text(REPORT)
    profile.main(["--summarize", str(tmp_path / "report.txt"), *options])
    return list(csv.DictReader(io.StringIO(capsys.readouterr().out)))


def test_steps_and_categories(tmp_path, capsys):
    rows = _csv(tmp_path, capsys)
    assert [(r["part"], r["name"], r["time_ms"], r["launches_per_step"]) for r in rows] == [
        ("step", "step (CUDA events)", "14.49", ""),
        ("step", "CUDA graph replay", "1.71", ""),
        ("step", "GPU kernel time", "1.45", "362"),
        ("step", "GPU idle", "13.03", ""),
        ("category", "gemm (cuBLAS/CUTLASS, our W8A8)", "0.992", ""),
        ("category", "attention", "0.234", ""),
        ("step", "step (CUDA events)", "100.0", ""),
        ("step", "GPU kernel time", "92.9", ""),
        ("step", "GPU idle", "7.0", ""),
        ("category", "optimizer", "9.19", ""),
    ]
    assert {r["report"] for r in rows} == {"report.txt"}
    assert rows[-1]["profile"] == "llmsys compiled"


def test_kernels_with_todays_category_and_time_per_launch(tmp_path, capsys):
    rows = _csv(tmp_path, capsys, "--kernels")
    assert [(r["profile"][:5], r["category"], r["time_ms"], r["per_launch_us"]) for r in rows] == [
        ("0.85b", "gemm (cuBLAS/CUTLASS, our W8A8)", "0.568", "8.875"),
        ("0.85b", "attention", "0.112", "7"),
        ("llmsy", "attention", "5.42", "338.8"),
    ]
