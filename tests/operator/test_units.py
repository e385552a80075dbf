"""Pure pieces of the operator that need no cluster: request labels, child preparation, cache relations."""

from __future__ import annotations

from typing import Any

from optest_helpers import small_rljob

from rlkube.operator.cache import Cache, JobState
from rlkube.operator.kube import resource_of
from rlkube.operator.reconciler import format_field_error, validate_body


def test_request_resource_labels_stay_low_cardinality() -> None:
    assert resource_of("/apis/ray.io/v1/namespaces/ns/rayjobs/x") == "rayjobs"
    assert resource_of("/apis/rlkube.io/v1alpha1/namespaces/ns/rljobs/x/status") == "rljobs/status"
    assert resource_of("/api/v1/namespaces/ns/events") == "events"
    assert resource_of("/api/v1/pods") == "pods"
    assert resource_of("/api/v1/namespaces") == "namespaces"


def test_field_errors_name_the_field() -> None:
    body = small_rljob("x", mounts=[{"name": "dshm", "mountPath": "/x", "hostPath": "/x"}])
    body["metadata"]["namespace"] = "ns"
    job, errors = validate_body(body)
    assert job is not None and errors and errors[0].startswith("spec.mounts[0].name: ")
    bad = small_rljob("y")
    bad["spec"]["trainer"]["gpusPerReplica"] = "many"
    job, errors = validate_body(bad)
    assert job is None and any(e.startswith("spec.trainer.gpusPerReplica") for e in errors)

    class E:
        field, message = "spec.a", "do b"

    assert format_field_error(E()) == "spec.a: do b"


def _owned(kind: str, name: str, uid: str, owner_kind: str, owner_uid: str, **extra: Any) -> dict[str, Any]:
    meta = {
        "name": name,
        "namespace": "ns",
        "uid": uid,
        "ownerReferences": [{"kind": owner_kind, "uid": owner_uid}],
    }
    return {"kind": kind, "metadata": meta, **extra}


def test_cache_links_pods_and_events_to_their_rljob_in_any_arrival_order() -> None:
    c = Cache()
    rl = {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1"},
    }
    pod = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "labels": {"ray.io/cluster": "j-abc", "ray.io/node-type": "head"},
        },
        "status": {"phase": "Running"},
    }
    assert c.put_pod(pod, deleted=False) is None  # cluster not known yet: cached, linked later
    key = c.put_rljob(rl, deleted=False)
    c.jobs[key] = JobState(ray_job_name="j")
    rj = _owned("RayJob", "j", "u2", "RLJob", "u1", spec={}, status={"rayClusterName": "j-abc"})
    assert c.put_rayjob(rj, deleted=False) == key
    rc = _owned(
        "RayCluster", "j-abc", "u3", "RayJob", "u2", spec={"workerGroupSpecs": [{"replicas": 1}]}, status={}
    )
    assert c.put_raycluster(rc, deleted=False) == key
    ev = {
        "metadata": {"namespace": "ns"},
        "type": "Warning",
        "reason": "FailedScheduling",
        "message": "m",
        "involvedObject": {"kind": "Pod", "name": "p"},
    }
    assert c.put_event(ev) == key
    got_rj, got_rc, pods, events = c.children_of(key)
    assert (
        got_rj
        and got_rc
        and [p["metadata"]["name"] for p in pods] == ["p"]
        and events[0]["reason"] == "FailedScheduling"
    )
    c.put_pod(pod, deleted=True)
    assert c.children_of(key)[2] == []


def test_request_verbs_are_the_api_servers_own() -> None:
    from rlkube.operator.kube import request_verb

    assert request_verb("GET", "/apis/ray.io/v1/namespaces/ns/rayjobs", "") == "LIST"
    assert request_verb("GET", "/apis/ray.io/v1/rayjobs", "labelSelector=x") == "LIST"
    assert request_verb("GET", "/apis/ray.io/v1/namespaces/ns/rayjobs", "watch=true") == "WATCH"
    assert request_verb("GET", "/apis/ray.io/v1/namespaces/ns/rayjobs/x", "") == "GET"
    assert request_verb("GET", "/api/v1/namespaces/ns", "") == "GET"
    assert request_verb("PATCH", "/apis/rlkube.io/v1alpha1/namespaces/ns/rljobs/x/status", "") == "PATCH"
