"""Chart tests share the operator tests' fixtures (CRD install, `rlkube-operator` subprocess)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from optest_fixtures import operator_factory, pytest_runtest_makereport, rljob_crd

__all__ = ["operator_factory", "pytest_runtest_makereport", "rljob_crd"]
