"""The root conftest.py seeds every test and provides ``run_ranks``; this one puts the tests'
shared helpers (sharded_optim_helpers.py) on the path, as ranks.py does for rank processes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
