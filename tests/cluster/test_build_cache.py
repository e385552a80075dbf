"""A warm build cache turns build.sh into a few seconds of checks (CI and `make test` rely on it)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

BUILD = Path(__file__).resolve().parents[2] / "devcluster" / "tools" / "build.sh"


def test_build_with_warm_cache_takes_seconds_and_reports_cached() -> None:
    start = time.monotonic()
    result = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    for component in ("kubernetes", "etcd", "kwok", "kuberay", "helm"):
        assert f"[build] {component} " in result.stdout and "cached" in result.stdout, result.stdout
    cached_lines = [line for line in result.stdout.splitlines() if ": cached in " in line]
    assert len(cached_lines) == 5, result.stdout
    assert "cold build" not in result.stdout
    assert took < 10, f"warm build took {took:.1f} s"
