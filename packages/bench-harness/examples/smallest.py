"""The smallest use of llmsys-bench-harness: time one op against a baseline, print its row."""

import tempfile
from pathlib import Path

import torch

import llmsys.bench_harness as harness

device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(256, 256, device=device)
eager = harness.time_ms(lambda: torch.relu(x) * 2, device=device, rep_ms=20)
fused = harness.time_ms(lambda: torch.clamp_min(x, 0).mul_(2), device=device, rep_ms=20)
bytes_moved = 2 * x.numel() * x.element_size()  # read x, write the output
rows = [
    harness.row("relu2", "eager", "fwd", "256x256", x.dtype, eager, work=bytes_moved),
    harness.row(
        "relu2", "fused", "fwd", "256x256", x.dtype, fused, work=bytes_moved, baseline=eager[1]
    ),
]
print(harness.markdown_table(rows))
with tempfile.TemporaryDirectory() as folder:
    path = harness.write_csv(rows, Path(folder) / f"{harness.device_slug(device)}.csv")
    assert harness.read_rows(path) == rows
print("bench-harness ok on", device, "| version", harness.__version__)
