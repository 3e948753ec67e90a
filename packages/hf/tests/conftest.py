"""Puts the tests' shared models (hf_models.py) on the path, as ranks.py does for rank
processes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
