"""Two operator replicas exactly as the chart renders them (peering on, `--priority=auto`, the peering
kind of the mode): exactly one acts on a new RLJob, and when it crashes the standby takes over.

The failover time printed is from SIGKILL of the active replica (no goodbye in the peering object: the
worst case; a clean exit hands over at once) to the RayJob of an RLJob created right after it.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CLUSTER, PEERED, start_as_chart
from optest_fixtures import OperatorProcess
from optest_helpers import small_rljob

from rlkube.devcluster.testing import Kubectl

WaitFor = Callable[..., Any]
FAILOVER_BOUND_S = 30


def _peers(kubectl: Kubectl, rel: dict[str, Any]) -> dict[str, Any]:
    name = rel["values"]["peering.name"]
    if rel["values"].get("mode") == "cluster":
        obj = kubectl.json("get", "clusterkopfpeering", name)
    else:
        obj = kubectl.json("-n", rel["jobs"], "get", "kopfpeering", name)
    return dict(obj.get("status") or {})


def _applied(op: OperatorProcess, ns: str, name: str) -> bool:
    """Whether this replica applied the children of RLJob ns/name (its log says so, once per apply)."""
    return f"of RLJob {ns}/{name} " in op.log()


@pytest.mark.parametrize(
    "release",
    [{**PEERED, "peering.name": "NAME"}, {**CLUSTER, **PEERED, "peering.name": "NAME"}],
    indirect=True,
    ids=["namespaced", "cluster"],
)
def test_two_replicas_from_the_chart_one_acts_and_a_standby_takes_over_within_30s(
    kubectl: Kubectl,
    release: dict[str, Any],
    operator_factory: Callable[..., OperatorProcess],
    wait_for: WaitFor,
    tmp_path: Path,
) -> None:
    jobs = release["jobs"]
    replicas = {
        pod: start_as_chart(kubectl, operator_factory, release, tmp_path, pod=pod)
        for pod in ("rlkube-a", "rlkube-b")
    }
    peers = wait_for(
        lambda: (p := _peers(kubectl, release)) and set(p) == set(replicas) and p, 30, what="both peers"
    )
    assert len({p["priority"] for p in peers.values()}) == 2, peers  # drawn apart: no tie pauses both
    time.sleep(2)  # each has seen the other's keep-alive

    kubectl("-n", jobs, "apply", "-f", "-", input=yaml.safe_dump(small_rljob("one", gpus=1)))
    wait_for(
        lambda: kubectl("-n", jobs, "get", "rayjob", "one", check=False).returncode == 0,
        60,
        what="RayJob one",
    )
    time.sleep(3)  # a second replica acting would have applied by now too
    acted = {pod for pod, op in replicas.items() if _applied(op, jobs, "one")}
    assert len(acted) == 1, {pod: op.log()[-2000:] for pod, op in replicas.items()}
    (active,) = acted
    expected = max(peers, key=lambda pod: peers[pod]["priority"])
    assert active == expected  # the highest priority acts
    (standby,) = set(replicas) - acted
    assert not [ln for ln in replicas[standby].log().splitlines() if f"{jobs}/" in ln and "applied" in ln]

    t0 = time.monotonic()
    replicas[active].stop(signal.SIGKILL)
    kubectl("-n", jobs, "apply", "-f", "-", input=yaml.safe_dump(small_rljob("two", gpus=1)))
    wait_for(
        lambda: kubectl("-n", jobs, "get", "rayjob", "two", check=False).returncode == 0,
        FAILOVER_BOUND_S + 30,
        what="the standby to act",
    )
    failover = time.monotonic() - t0
    sys.stderr.write(
        f"\n[peering] {release['values'].get('mode', 'namespaced')}: "
        f"failover after SIGKILL {failover:.1f} s\n"
    )
    assert failover < FAILOVER_BOUND_S
    assert _applied(replicas[standby], jobs, "two")
