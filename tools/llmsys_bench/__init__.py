"""Workspace benchmark tooling shared by every package's benchmarks (not a published package).

- ``harness``: timing, device rooflines and the one tidy CSV schema.
- ``report``: the main job, which runs every package's sweep and writes ``reports/``.
- ``compare``: a new pytest-benchmark run against a committed baseline.
"""
