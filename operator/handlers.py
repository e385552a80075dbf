"""Kopf bindings: which watch events and lifecycle causes reach which reconcile.

Everything lives on :data:`REGISTRY` (not Kopf's global one) so tests and the CLI load exactly this set.
Handlers return nothing: a Kopf return value lands in ``status.<handler>`` and the typed schema prunes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from rlkube.api.contract import ANNOTATION_PREFIX, FINALIZER, GROUP, JOB_LABEL, PLURAL, VERSION

from . import metrics
from .apply import ChildConflict, ChildRefused
from .cache import Key
from .kube import Kube, KubeError, make_session
from .reconciler import Reconciler

RLJOB = (GROUP, VERSION, PLURAL)
RAYJOB = ("ray.io", "v1", "rayjobs")
RAYCLUSTER = ("ray.io", "v1", "rayclusters")
PODS = ("v1", "pods")
EVENTS = ("v1", "events")
# Children other than the RayJob: watched only for deletions (recreate while the job is active).
SIMPLE_CHILDREN = (
    ("v1", "configmaps"),
    ("v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
)

REGISTRY = kopf.OperatorRegistry()
log = logging.getLogger("rlkube.operator")


def _rec(memo: Any) -> Reconciler:
    rec: Reconciler = memo["reconciler"]
    return rec


def _key(body: Any) -> Key:
    return (str(body["metadata"]["namespace"]), str(body["metadata"]["name"]))


@kopf.on.startup(registry=REGISTRY)
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Finalizer and bookkeeping under rlkube.io; server-side selectors so we watch only what we need."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.posting.enabled = False  # our own Events, one per transition, not one per handler run
    settings.watching.label_selectors[PODS] = "ray.io/cluster"
    for child in SIMPLE_CHILDREN:
        settings.watching.label_selectors[child] = JOB_LABEL
    # Cluster-wide mode: excluded namespaces never reach the operator (one selector string per kind).
    skip = [f"metadata.namespace!={ns}" for ns in _rec(memo).config.exclude_namespaces]
    for kind in (RLJOB, RAYJOB, RAYCLUSTER, PODS, *SIMPLE_CHILDREN):
        if skip:
            settings.watching.field_selectors[kind] = ",".join(skip)
    settings.watching.field_selectors[EVENTS] = ",".join(["type=Warning", *skip])
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    _rec(memo).start()


@kopf.on.cleanup(registry=REGISTRY)
async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    await _rec(memo).stop()


@kopf.on.login(registry=REGISTRY)
async def login(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> kopf.AiohttpSession:
    """In-cluster token or kubeconfig; one counted session shared by Kopf and our own calls."""
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no in-cluster ServiceAccount token and no kubeconfig (set KUBECONFIG)")
    session = make_session(info)
    _rec(memo).kube = Kube(session, info.server)
    return kopf.AiohttpSession(
        server=info.server, default_namespace=info.default_namespace, aiohttp_session=session
    )


@kopf.on.probe(id=PLURAL, registry=REGISTRY)
def probe_rljobs(memo: kopf.Memo, **_: Any) -> int:
    return len(_rec(memo).cache.rljobs)


# ------------------------------------------------------------------------------------------ RLJob


@kopf.on.resume(*RLJOB, id="reconcile", registry=REGISTRY)
@kopf.on.create(*RLJOB, id="reconcile", registry=REGISTRY)
@kopf.on.update(*RLJOB, id="reconcile", registry=REGISTRY)
async def reconcile(
    *, body: kopf.Body, logger: logging.Logger | logging.LoggerAdapter[Any], memo: Any, retry: int, **_: Any
) -> None:
    """Validate, render, apply. Bad input stops here (Valid=False, no retry); API trouble backs off."""
    rec = _rec(memo)
    t0 = time.perf_counter()
    metrics.RECONCILES.labels("spec").inc()
    try:
        await rec.reconcile_spec(body, logger)
    except (ChildConflict, ChildRefused) as exc:
        # On the RLJob already (ClusterReady + a Warning Event); look again later: the quota may be
        # raised, the foreign object deleted. Not an operator error.
        raise kopf.TemporaryError(str(exc), delay=min(60, 5 * 2**retry)) from exc
    except KubeError as exc:
        metrics.RECONCILE_ERRORS.labels("spec").inc()
        raise kopf.TemporaryError(
            f"applying children failed: {exc}", delay=min(60, 2 ** (retry + 1))
        ) from exc
    except Exception:
        metrics.RECONCILE_ERRORS.labels("spec").inc()
        raise
    finally:
        metrics.RECONCILE_DURATION.labels("spec").observe(time.perf_counter() - t0)


@kopf.on.delete(*RLJOB, registry=REGISTRY)
async def deleted(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Children carry ownerReferences: the garbage collector removes them; we only forget the job."""
    _rec(memo).forget(_key(body), body)


@kopf.on.event(*RLJOB, registry=REGISTRY)
async def rljob_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    rec = _rec(memo)
    body = event["object"]
    gone = event["type"] == "DELETED"
    key = rec.cache.put_rljob(body, deleted=gone)
    if not gone:
        rec.mark(key)


# --------------------------------------------------------------------------------------- children


@kopf.on.event(*RAYJOB, registry=REGISTRY)
async def rayjob_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    rec = _rec(memo)
    gone = event["type"] == "DELETED"
    rec.mark(rec.cache.put_rayjob(event["object"], deleted=gone))
    if gone:
        _recreate(rec, event["object"])


@kopf.on.event(*RAYCLUSTER, registry=REGISTRY)
async def raycluster_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    rec = _rec(memo)
    rec.mark(rec.cache.put_raycluster(event["object"], deleted=event["type"] == "DELETED"))


@kopf.on.event(*PODS, labels={"ray.io/cluster": kopf.PRESENT}, registry=REGISTRY)
async def pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    rec = _rec(memo)
    rec.mark(rec.cache.put_pod(event["object"], deleted=event["type"] == "DELETED"))


@kopf.on.event(*EVENTS, registry=REGISTRY)
async def warning_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    if event["type"] == "DELETED" or event["object"].get("type") != "Warning":
        return
    rec = _rec(memo)
    rec.mark(rec.cache.put_event(event["object"]))


async def _child_deleted(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    if event["type"] == "DELETED":
        _recreate(_rec(memo), event["object"])


for _child in SIMPLE_CHILDREN:
    kopf.on.event(*_child, labels={JOB_LABEL: kopf.PRESENT}, id=f"child-{_child[-1]}", registry=REGISTRY)(
        _child_deleted
    )


_background: set[asyncio.Task[None]] = set()


def _recreate(rec: Reconciler, child: Any) -> None:
    """A child was deleted by hand (or by anyone but the GC of a deleted RLJob): apply the job again."""
    key = rec.child_deleted(child)
    if key is None:
        return
    log.info(
        "%s %s of RLJob %s/%s was deleted; recreating", child.get("kind"), child["metadata"]["name"], *key
    )
    task = asyncio.create_task(_reapply(rec, key))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _reapply(rec: Reconciler, key: Key) -> None:
    for attempt in range(6):
        body = rec.cache.rljobs.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        metrics.RECONCILES.labels("spec").inc()
        try:
            await rec.reconcile_spec(body, log)
            return
        except (KubeError, ChildConflict, ChildRefused) as exc:
            metrics.RECONCILE_ERRORS.labels("spec").inc()
            log.warning("recreating children of %s/%s failed (%s); retry %d", *key, exc, attempt + 1)
            await asyncio.sleep(2**attempt)
