"""Make the shared spec builders (specs.py) importable from the API and render tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "api"))
