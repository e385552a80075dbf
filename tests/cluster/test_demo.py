"""`make demo` end to end in real pods: helm-installed operator, KubeRay's Ray and submitter, the
tiny RLJob trained in the cluster with its progress pushed from the pod.

Runs the demo exactly as `make demo` does (a subprocess of `python -m rlkube.devcluster.demo`) on
the session's cluster (the machine has one real node, which the session's cluster holds), in its own
namespace; `--down` leaves a cluster it did not start running, as `make demo` then `make test` must.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlkube.devcluster.realpods import uninstall_operator
from rlkube.devcluster.testing import Kubectl, TestCluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny-arith.yaml"


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.realpods
@pytest.mark.timeout(2400)
def test_make_demo_end_to_end(tmp_path: Path, devcluster: TestCluster, kubectl: Kubectl) -> None:
    if devcluster.local is None:
        pytest.fail("the demo runs on the local devcluster, not on RLKUBE_TEST_KUBECONFIG", pytrace=False)
    state_dir, summary = devcluster.local.state_dir, tmp_path / "summary.json"
    argv = [
        sys.executable, "-m", "rlkube.devcluster.demo",
        "--state-dir", str(state_dir),
        "--namespace", "demo-test", "--summary", str(summary), "--down", "--interval", "10",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    env.pop("KUBECONFIG", None)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=2300, cwd=REPO)
    finally:
        uninstall_operator(kubectl, "rlkube-system", "rlkube")
        kubectl("delete", "namespace", "demo-test", "--wait=false", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{out[-6000:]}"

    # The story it tells, in order.
    at = 0
    for line in (
        "1/7", "2/7", "3/7", "operator pod", "4/7", "5/7", "a real container",
        "6/7", "status.progress of rljob", "is Succeeded", "7/7", "reward curve", "TensorBoard",
        "held-out reward",
    ):  # fmt: skip
        assert line in proc.stdout[at:], (
            f"{line!r} missing or out of order in the demo output:\n{out[-6000:]}"
        )
        at = proc.stdout.index(line, at)

    total = yaml.safe_load(EXAMPLE.read_text())["spec"]["training"]["totalSteps"]
    result = json.loads(summary.read_text())
    status = result["rljob"]["status"]
    assert status["phase"] == "Succeeded", status
    assert status["progress"]["step"] == total, status["progress"]
    assert status["progress"].get("rewardMean") is not None, status["progress"]
    # STEP moved while it ran: some `kubectl get rljobs` row showed a step between 1 and total-1.
    steps = [tok for line in out.splitlines() if "tiny-arith" in line for tok in line.split() if "/" in tok]
    assert any(s.split("/")[0].isdigit() and 0 < int(s.split("/")[0]) < total for s in steps), out[-4000:]

    # The pods were real and on the real node; the progress came from the pod (the job's own log).
    assert result["pods"] and all("real-cpu-000" in p for p in result["pods"]), result["pods"]
    assert "status.progress of rljob demo-test/tiny-arith pushed" in result["submitter_log"]
    # It never looked Failed on the way.
    assert not [line for line in out.splitlines() if "tiny-arith" in line and " Failed " in line], out[-4000:]

    curve = Path(result["reward_curve"])
    assert curve.is_file() and curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(x) for x in Path(result["metrics"]).read_text().splitlines() if x.strip()]
    assert max(r["step"] for r in rows) == total
    assert any(Path(result["tensorboard"]).glob("events.out.tfevents.*"))
    assert len(result["heldout_reward"]) >= 2

    # --down left the cluster it did not start running (the session's).
    assert "left running" in proc.stdout, out[-2000:]
    assert devcluster.local.healthy()
