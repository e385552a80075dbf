"""Issue 11: a spec change after creation was accepted and never reached the children. Now each field
either reaches them (live fields at once, the rest through suspend -> edit -> resume) or is refused at
`kubectl apply` (tests/api/test_api_cluster.py shows the refusals)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import yaml
from optest_fixtures import OperatorProcess
from optest_helpers import apply, cond_is, describe, rljob, small_rljob

from rlkube.devcluster.testing import Kubectl

WaitFor = Callable[..., Any]


def _patch(kubectl: Kubectl, ns: str, spec: dict[str, Any]) -> None:
    kubectl("-n", ns, "patch", "rljob", "edit", "--type=merge", "-p", json.dumps({"spec": spec}))


def _workers(kubectl: Kubectl, ns: str) -> int | None:
    name = kubectl.json("-n", ns, "get", "rayjob", "edit")["status"].get("rayClusterName")
    if not name:
        return None
    got = kubectl("-n", ns, "get", "raycluster", name, "-o", "json", check=False)
    if got.returncode != 0:
        return None
    return int(json.loads(got.stdout)["spec"]["workerGroupSpecs"][0]["replicas"])


def test_live_fields_roll_out_at_once_and_the_rest_on_resume(
    kubectl: Kubectl, namespace: str, operator: OperatorProcess, wait_for: WaitFor
) -> None:
    ns = namespace
    apply(kubectl, ns, small_rljob("edit", gpus=1))
    wait_for(cond_is(kubectl, ns, "edit", "ClusterReady", "True"), 90, describe(kubectl, ns, "edit"))
    assert _workers(kubectl, ns) == 1

    _patch(kubectl, ns, {"activeDeadlineSeconds": 7200, "backoffLimit": 1})
    wait_for(
        lambda: kubectl.json("-n", ns, "get", "rayjob", "edit")["spec"].get("activeDeadlineSeconds") == 7200,
        30,
        what="the live field on the RayJob",
    )
    assert kubectl.json("-n", ns, "get", "rayjob", "edit")["spec"]["backoffLimit"] == 1

    _patch(kubectl, ns, {"suspend": True})
    wait_for(
        lambda: rljob(kubectl, ns, "edit")["status"]["phase"] == "Suspended",
        60,
        describe(kubectl, ns, "edit"),
    )
    _patch(kubectl, ns, {"trainer": {"replicas": 2}, "training": {"totalSteps": 20}})
    _patch(kubectl, ns, {"suspend": False})
    wait_for(lambda: _workers(kubectl, ns) == 2, 120, describe(kubectl, ns, "edit"))
    wait_for(cond_is(kubectl, ns, "edit", "ClusterReady", "True"), 120, describe(kubectl, ns, "edit"))
    config = yaml.safe_load(kubectl.json("-n", ns, "get", "configmap", "edit-config")["data"]["rljob.yaml"])
    assert (config["spec"]["trainer"]["replicas"], config["spec"]["training"]["totalSteps"]) == (2, 20)
    status = rljob(kubectl, ns, "edit")["status"]
    assert status["observedGeneration"] == rljob(kubectl, ns, "edit")["metadata"]["generation"]
