"""The tests' shared helpers (attn_helpers.py) on the path. (The root conftest.py runs Triton under
the interpreter on CPU-only machines, skips `gpu` tests there, and provides the `device`, seed and
`poisoned_allocations` fixtures; it forgets recorded replays before every test.)"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
