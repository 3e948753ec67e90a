"""Test configuration of kernels-int8: the autotuner off by default. (The root conftest.py runs
Triton under the interpreter on CPU-only machines, skips `gpu` tests there, and provides the
`device`, seed and `poisoned_allocations` fixtures.)

pytest imports this file before any test module, so the environment variable is set before the
package is imported.
"""

import os

# Take each shape's first (best-measured) GEMM configuration instead of timing them all; the
# tests that need the tuner turn it back on.
os.environ.setdefault("LLMSYS_INT8_AUTOTUNE", "0")
