"""Workspace benchmark tooling shared by every package's benchmarks (not a published package).

- ``harness``: the timer, device rooflines, the row builder and the one tidy CSV schema.
- ``report``: the main job, which runs every package's sweep and writes ``reports/``.

Baselines are compared by pytest-benchmark itself (``tools/gpu.py``).
"""
