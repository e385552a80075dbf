"""Fixtures for operator and chart tests: the RLJob CRD, and `rlkube-operator` as a subprocess.

The operator runs exactly as a Deployment runs it (the console script, flags, its own kubeconfig), watching
only the test's namespace so tests stay independent of each other and of other engineers' sessions.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlkube.devcluster.testing import Kubectl

REPO = Path(__file__).resolve().parents[2]
CRD_FILES = [
    REPO / "crds" / "rljobs.rlkube.io.yaml",
    REPO / "charts" / "rlkube" / "crds" / "kopfpeerings.kopf.dev.yaml",
]
OPERATOR_BIN = Path(sys.executable).parent / "rlkube-operator"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def rljob_crd(kubectl: Kubectl) -> None:
    """The generated RLJob CRD (and Kopf's peering CRDs), applied server-side and Established."""
    for path in CRD_FILES:
        assert path.is_file(), f"missing {path} (run `make crds`)"
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    kubectl.wait_established("rljobs.rlkube.io")


@dataclass
class OperatorProcess:
    """One running `rlkube-operator`; `.metrics()` scrapes it, `.log()` reads what it printed."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int
    liveness_port: int
    argv: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    def metric(self, name: str, /, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, lbl = head.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in lbl for k, v in labels.items()):
                total += float(value)
        return total

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_operator(
    kubeconfig: Path,
    log_dir: Path,
    *args: str,
    namespaces: list[str] | None = None,
    wait: bool = True,
    env: dict[str, str] | None = None,
) -> OperatorProcess:
    """Start `rlkube-operator` and wait until its liveness endpoint answers (it has logged in and started)."""
    assert OPERATOR_BIN.is_file(), f"{OPERATOR_BIN} missing: run `bash .ci/python-env.sh`"
    mport, lport = free_port(), free_port()
    argv = [
        str(OPERATOR_BIN),
        f"--metrics-port={mport}",
        "--metrics-addr=127.0.0.1",
        f"--liveness=http://127.0.0.1:{lport}/healthz",
        "--log-format=json",
        *[f"--namespace={ns}" for ns in namespaces or ()],
        *args,
    ]
    if "--peering" not in " ".join(args):
        argv.append("--standalone")
    env = {**os.environ, **(env or {}), "KUBECONFIG": str(kubeconfig), "PYTHONSAFEPATH": "1"}
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"operator-{mport}.log"
    out = log_path.open("wb")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    op = OperatorProcess(proc, log_path, mport, lport, argv)
    if wait:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"rlkube-operator exited {proc.returncode}:\n{op.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{lport}/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                op.stop(signal.SIGKILL)
                raise AssertionError(f"rlkube-operator not live after 60 s:\n{op.log()[-4000:]}")
            time.sleep(0.3)
    return op


@pytest.fixture
def operator_factory(
    kubeconfig: Path, rljob_crd: None, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., OperatorProcess]]:
    """`operator_factory(*flags, namespaces=[ns], kubeconfig=...)` -> a live operator, stopped afterwards."""
    started: list[OperatorProcess] = []

    def make(
        *args: str,
        namespaces: list[str] | None = None,
        kubeconfig_path: Path | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> OperatorProcess:
        op = start_operator(
            kubeconfig_path or kubeconfig, tmp_path, *args, namespaces=namespaces, wait=wait, env=env
        )
        started.append(op)
        return op

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for op in started:
        op.stop()
        if failed:
            sys.stderr.write(f"\n--- operator log ({op.log_path}) ---\n{op.log()[-6000:]}\n")


@pytest.fixture
def operator(operator_factory: Callable[..., OperatorProcess], namespace: str) -> OperatorProcess:
    """A standalone operator watching only this test's namespace."""
    return operator_factory(namespaces=[namespace])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
