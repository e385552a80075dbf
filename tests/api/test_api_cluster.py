"""The CRD on the real API server: examples apply, bad specs are refused by `kubectl apply` itself
with the field and the fix, immutable fields stay put, and `kubectl get rljobs` shows the columns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from specs import BAD, BAD_SCHEMA, EXAMPLES, admit_and_render, minimal

from rlkube.devcluster.testing import Kubectl

CRD = Path(__file__).resolve().parents[2] / "crds" / "rljobs.rlkube.io.yaml"


@pytest.fixture(scope="module")
def crd(kubectl: Kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl.wait_established("rljobs.rlkube.io")


def _dry_run(kubectl: Kubectl, namespace: str, obj: dict[str, Any]) -> Any:
    return kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_apply_and_their_children_are_accepted(
    crd: None, kubectl: Kubectl, namespace: str, path: Path
) -> None:
    raw = yaml.safe_load(path.read_text())
    done = _dry_run(kubectl, namespace, raw)
    assert done.returncode == 0, done.stderr
    children = admit_and_render(raw, namespace=namespace)
    text = yaml.safe_dump_all(children.all())
    done = kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", input=text, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("case", "job", "field"), BAD + BAD_SCHEMA, ids=[c[0] for c in BAD + BAD_SCHEMA])
def test_kubectl_apply_refuses_bad_specs_naming_the_field(
    crd: None, kubectl: Kubectl, namespace: str, case: str, job: dict[str, Any], field: str
) -> None:
    job = {**job, "metadata": {"name": f"bad-{case}"}}
    done = _dry_run(kubectl, namespace, job)
    assert done.returncode != 0
    assert field in done.stderr, done.stderr


def test_defaults_immutability_and_columns(crd: None, kubectl: Kubectl, namespace: str) -> None:
    job = {**minimal(), "metadata": {"name": "cols", "namespace": namespace}}
    kubectl.apply(job)
    stored = kubectl.json("get", "rljob", "cols", "-n", namespace)
    assert stored["spec"]["training"]["mode"] == "sync"
    assert stored["spec"]["algorithm"]["kl"]["klLossType"] == "low_var_kl"
    assert "async" not in stored["spec"]

    status = {
        "status": {
            "phase": "Running",
            "gpus": 1,
            "reason": "RayJobRunning",
            "rayJobName": "cols",
            "conditions": [{"type": "Valid", "status": "True", "reason": "SpecAccepted", "message": ""}],
            "progress": {"step": 12, "totalSteps": 100, "stepDisplay": "12/100", "rewardMean": 0.31},
        }
    }
    kubectl(
        "patch",
        "rlj",
        "cols",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
    wide = kubectl("get", "rljobs", "-n", namespace, "-o", "wide").stdout.split("\n")
    assert wide[0].split() == [
        "NAME",
        "PHASE",
        "ALGORITHM",
        "MODE",
        "GPUS",
        "STEP",
        "REWARD",
        "AGE",
        "REASON",
        "RAYJOB",
    ]
    row = wide[1].split()
    assert row[:7] == ["cols", "Running", "grpo", "sync", "1", "12/100", "0.31"]
    assert row[-2:] == ["RayJobRunning", "cols"]

    patch = json.dumps({"spec": {"training": {"mode": "separate_async"}}})
    done = kubectl("patch", "rlj", "cols", "-n", namespace, "--type=merge", "-p", patch, check=False)
    assert done.returncode != 0 and "training.mode is immutable" in done.stderr
    done = kubectl("patch", "rlj", "cols", "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    assert kubectl.json("get", "rlj", "cols", "-n", namespace)["spec"]["suspend"] is True


def test_a_running_rljob_changes_only_live_fields_and_everything_else_while_suspended(
    crd: None, kubectl: Kubectl, namespace: str
) -> None:
    """Issue 11: a spec change after creation was accepted and never reached the children."""
    job = {**minimal(), "metadata": {"name": "edit", "namespace": namespace}}
    kubectl.apply(job)

    def patch(spec: dict[str, Any]) -> Any:
        body = json.dumps({"spec": spec})
        return kubectl("patch", "rlj", "edit", "-n", namespace, "--type=merge", "-p", body, check=False)

    for change in ({"trainer": {"replicas": 2}}, {"image": "rlkube/runtime:2"}, {"env": [{"name": "A"}]}):
        done = patch(change)
        assert done.returncode != 0 and "set spec.suspend: true, edit, then set it back" in done.stderr
    for live in ({"activeDeadlineSeconds": 600}, {"backoffLimit": 2}, {"ttlSecondsAfterFinished": 60}):
        assert patch(live).returncode == 0
    done = patch({"suspend": True, "trainer": {"replicas": 2}})
    assert done.returncode != 0  # suspend first, then edit: the edit must not race a running cluster
    assert patch({"suspend": True}).returncode == 0
    assert patch({"trainer": {"replicas": 2}, "image": "rlkube/runtime:2"}).returncode == 0
    assert patch({"training": {"mode": "separate_async"}}).returncode != 0  # immutable even then
    assert patch({"suspend": False}).returncode == 0
    stored = kubectl.json("get", "rlj", "edit", "-n", namespace)["spec"]
    assert (stored["trainer"]["replicas"], stored["image"], stored["suspend"]) == (
        2,
        "rlkube/runtime:2",
        False,
    )


def test_long_names_are_refused(crd: None, kubectl: Kubectl, namespace: str) -> None:
    done = _dry_run(kubectl, namespace, {**minimal(), "metadata": {"name": "n" * 64}})
    assert done.returncode != 0 and "at most 63 characters" in done.stderr
