"""Real-pod test fixtures (realpods_helpers.py): the operator as a pod, an `rp-*` namespace per test."""

from realpods_helpers import realpods, rp_namespace

__all__ = ["realpods", "rp_namespace"]
