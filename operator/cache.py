"""The operator's watch cache: slim copies of RLJobs and their children, fed by Kopf's watch streams.

Status is derived from this cache, never from extra GETs, which keeps API requests per RLJob to the
writes it must make. Objects are trimmed to the fields :mod:`rlkube.operator.status` reads so 500 jobs
with ~1500 pods stay a few MB.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Key = tuple[str, str]  # (namespace, name)

EVENTS_PER_OBJECT = 5


def _meta(obj: Mapping[str, Any], *extra: str) -> dict[str, Any]:
    m = obj.get("metadata") or {}
    keep = ("name", "namespace", "uid", "labels", "deletionTimestamp", "creationTimestamp", *extra)
    return {k: m[k] for k in keep if k in m}


def owner_uid(obj: Mapping[str, Any], kind: str) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("kind") == kind:
            return str(ref.get("uid"))
    return None


def slim_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    st = pod.get("status") or {}

    def cs(items: Any) -> list[dict[str, Any]]:
        keep = ("name", "ready", "restartCount", "state", "lastState", "image")
        return [{k: c[k] for k in keep if k in c} for c in items or ()]

    conds = [
        {k: c[k] for k in ("type", "status", "reason", "message") if k in c}
        for c in st.get("conditions") or ()
    ]
    # Each container's memory limit only (an OOMKilled message names it).
    limits = [
        {"name": c.get("name"), "resources": {"limits": {"memory": mem}}}
        for c in (pod.get("spec") or {}).get("containers") or ()
        if (mem := ((c.get("resources") or {}).get("limits") or {}).get("memory"))
    ]
    return {
        "metadata": _meta(pod),
        "spec": {"containers": limits},
        "status": {
            "phase": st.get("phase"),
            "reason": st.get("reason"),
            "message": st.get("message"),
            "conditions": conds,
            "containerStatuses": cs(st.get("containerStatuses")),
            "initContainerStatuses": cs(st.get("initContainerStatuses")),
        },
    }


def slim_event(ev: Mapping[str, Any]) -> dict[str, Any]:
    obj = ev.get("involvedObject") or ev.get("regarding") or {}
    return {
        "type": ev.get("type"),
        "reason": ev.get("reason"),
        "message": ev.get("message") or ev.get("note"),
        "involvedObject": {"kind": obj.get("kind"), "name": obj.get("name")},
    }


@dataclass
class JobState:
    """What the spec handler learned about one RLJob (not in the API: recomputed on restart/resume)."""

    generation: int = 0
    validation_errors: list[str] | None = None
    applied_generation: int | None = None
    ray_job_name: str = ""
    kueue_managed: bool = False
    algorithm: str = ""
    mode: str = ""
    gpus: int | None = None
    running_seen: bool = False
    # The renderer's warnings already posted as Events (posted again only when they change).
    spec_warnings: list[Any] = field(default_factory=list)
    # InvalidSpec (the API's rules) or PolicyViolation (the admin policy), with validation_errors.
    validation_reason: str = "InvalidSpec"
    # Why the last spec reconcile wrote no children: a status.Problem (ChildConflict, QuotaExceeded, ...).
    child_problem: Any = None


@dataclass
class Cache:
    rljobs: dict[Key, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[Key, JobState] = field(default_factory=dict)
    rayjobs: dict[Key, dict[str, Any]] = field(default_factory=dict)
    rayclusters: dict[Key, dict[str, Any]] = field(default_factory=dict)
    pods: dict[Key, dict[str, Any]] = field(default_factory=dict)
    pods_by_cluster: dict[Key, set[str]] = field(default_factory=dict)
    events: dict[tuple[str, str, str], deque[dict[str, Any]]] = field(default_factory=dict)
    rljob_by_uid: dict[str, Key] = field(default_factory=dict)
    rayjob_by_uid: dict[str, Key] = field(default_factory=dict)

    # ------------------------------------------------------------------ updates (return the owning RLJob)

    def put_rljob(self, body: Mapping[str, Any], deleted: bool) -> Key:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if deleted:
            old = self.rljobs.pop(key, None)
            self.jobs.pop(key, None)
            if old:
                self.rljob_by_uid.pop(str(old["metadata"].get("uid")), None)
            return key
        self.rljobs[key] = {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "metadata": _meta(body, "generation", "resourceVersion"),
            "spec": dict(body.get("spec") or {}),
            "status": dict(body.get("status") or {}),
        }
        self.rljob_by_uid[str(meta.get("uid"))] = key
        return key

    def put_rayjob(self, body: Mapping[str, Any], deleted: bool) -> Key | None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if deleted:
            self.rayjobs.pop(key, None)
            self.rayjob_by_uid.pop(str(meta.get("uid")), None)
        else:
            self.rayjobs[key] = {
                "metadata": _meta(body, "ownerReferences"),
                "spec": {"suspend": (body.get("spec") or {}).get("suspend", False)},
                "status": dict(body.get("status") or {}),
            }
            self.rayjob_by_uid[str(meta.get("uid"))] = key
        owner = owner_uid(body, "RLJob")
        return self.rljob_by_uid.get(owner) if owner else None

    def put_raycluster(self, body: Mapping[str, Any], deleted: bool) -> Key | None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if deleted:
            self.rayclusters.pop(key, None)
        else:
            spec = body.get("spec") or {}
            self.rayclusters[key] = {
                "metadata": _meta(body, "ownerReferences"),
                "spec": {
                    "workerGroupSpecs": [
                        {"replicas": g.get("replicas", 0)} for g in spec.get("workerGroupSpecs") or ()
                    ]
                },
                "status": dict(body.get("status") or {}),
            }
        return self.rljob_of_cluster(key, body)

    def put_pod(self, body: Mapping[str, Any], deleted: bool) -> Key | None:
        meta = body.get("metadata") or {}
        ns, name = str(meta.get("namespace")), str(meta.get("name"))
        cluster = (meta.get("labels") or {}).get("ray.io/cluster")
        if not cluster:
            return None
        ckey = (ns, str(cluster))
        if deleted:
            self.pods.pop((ns, name), None)
            self.pods_by_cluster.get(ckey, set()).discard(name)
            self.events.pop((ns, "Pod", name), None)
        else:
            self.pods[(ns, name)] = slim_pod(body)
            self.pods_by_cluster.setdefault(ckey, set()).add(name)
        return self.rljob_of_cluster(ckey, None)

    def put_event(self, body: Mapping[str, Any]) -> Key | None:
        ev = slim_event(body)
        ns = str((body.get("metadata") or {}).get("namespace"))
        kind, name = str(ev["involvedObject"]["kind"]), str(ev["involvedObject"]["name"])
        if kind == "Pod":
            pod = self.pods.get((ns, name))
            cluster = ((pod or {}).get("metadata") or {}).get("labels", {}).get("ray.io/cluster")
            owner = self.rljob_of_cluster((ns, str(cluster)), None) if cluster else None
        elif kind == "RayCluster":
            owner = self.rljob_of_cluster((ns, name), None)
        elif kind == "RayJob":
            rj = self.rayjobs.get((ns, name))
            uid = owner_uid(rj, "RLJob") if rj else None
            owner = self.rljob_by_uid.get(uid) if uid else None
        else:
            return None
        if owner is None:
            return None
        self.events.setdefault((ns, kind, name), deque(maxlen=EVENTS_PER_OBJECT)).append(ev)
        return owner

    # ------------------------------------------------------------------ relations

    def rljob_of_cluster(self, ckey: Key, body: Mapping[str, Any] | None) -> Key | None:
        cluster = body or self.rayclusters.get(ckey)
        if cluster is not None:
            uid = owner_uid(cluster, "RayJob")
            rjkey = self.rayjob_by_uid.get(uid) if uid else None
        else:
            rjkey = None
        if rjkey is None:  # the cluster may arrive before its RayJob, or without an ownerReference
            rjkey = next(
                (
                    k
                    for k, rj in self.rayjobs.items()
                    if rj["status"].get("rayClusterName") == ckey[1] and k[0] == ckey[0]
                ),
                None,
            )
        if rjkey is None:
            return None
        uid = owner_uid(self.rayjobs[rjkey], "RLJob")
        return self.rljob_by_uid.get(uid) if uid else None

    def children_of(
        self, key: Key
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]]]:
        """(RayJob, current RayCluster, its pods, recent Warning events) for one RLJob."""
        ns = key[0]
        state = self.jobs.get(key)
        rljob = self.rljobs.get(key)
        rj = None
        if state and state.ray_job_name:
            rj = self.rayjobs.get((ns, state.ray_job_name))
        if rj is None and rljob is not None:
            uid = rljob["metadata"].get("uid")
            rj = next(
                (
                    r
                    for r in self.rayjobs.values()
                    if owner_uid(r, "RLJob") == uid and r["metadata"].get("namespace") == ns
                ),
                None,
            )
        if rj is None:
            return None, None, [], []
        rj_name = str(rj["metadata"]["name"])
        cname = rj["status"].get("rayClusterName")
        cluster = self.rayclusters.get((ns, cname)) if cname else None
        if cluster is None:
            rj_uid = rj["metadata"].get("uid")
            found = [
                (k, c) for k, c in self.rayclusters.items() if k[0] == ns and owner_uid(c, "RayJob") == rj_uid
            ]
            if found:
                cname, cluster = found[-1][0][1], found[-1][1]
        pods = (
            [
                self.pods[(ns, p)]
                for p in sorted(self.pods_by_cluster.get((ns, str(cname)), ()))
                if (ns, p) in self.pods
            ]
            if cname
            else []
        )
        events: list[dict[str, Any]] = []
        for kind, name in [("RayJob", rj_name), ("RayCluster", str(cname))] + [
            ("Pod", p["metadata"]["name"]) for p in pods
        ]:
            events.extend(self.events.get((ns, kind, name), ()))
        return rj, cluster, pods, events
