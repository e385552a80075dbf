"""Operator tests: fixtures come from optest_fixtures (shared with tests/chart)."""

from optest_fixtures import operator, operator_factory, pytest_runtest_makereport, rljob_crd

__all__ = ["operator", "operator_factory", "pytest_runtest_makereport", "rljob_crd"]
