"""Applying one attempt's children: ownership first, then create or converge, and undo a refused attempt.

Before anything is written, every child is looked up. A missing one is created, one this RLJob
controls (its controller ownerReference carries the RLJob's uid) is converged by server-side apply
with its uid as a precondition (a replaced object is never written), and anything else is a conflict:
nothing is written and the conflict names the object. Writes go in dependency waves; when the API
server refuses one (quota on object counts, an admission policy, a schema), the children this attempt
created are deleted again (uid-preconditioned), so a refused attempt leaves nothing behind.

Creation is a server-side apply too (one field manager owns every field from the start, so a field
the renderer stops sending is removed). The window between the lookup and the create is closed by the
chart's operator guard (an admission policy refusing the operator's writes to objects it does not
own); without it, an object made in those milliseconds by someone who may create it anyway would be
converged like ours.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .kube import Kube, KubeError

# The API server's answers that refuse a child for good (until someone changes the cluster): forbidden
# (quota, admission), invalid. Anything else (a timeout, a 5xx) also rolls the attempt back, but is
# raised as itself: the handler retries it as an operator error, not a refusal to show on the RLJob.
REFUSED = frozenset({400, 403, 409, 422})


@dataclass(frozen=True)
class Created:
    """A child this attempt created (what a rollback deletes)."""

    kind: str
    name: str
    uid: str


class ChildConflict(Exception):
    """Children exist under our names but are not ours; nothing was written."""

    def __init__(self, objects: Sequence[str]) -> None:
        self.objects = list(objects)
        super().__init__(
            "; ".join(self.objects) + ": not created by this RLJob, so rlkube leaves them alone. Delete or "
            "rename them, or rename the RLJob"
        )


class ChildRefused(Exception):
    """The API server refused a child; the children created in this attempt were deleted again."""

    def __init__(self, kind: str, name: str, error: KubeError, rolled_back: Sequence[Created]) -> None:
        self.kind, self.name, self.error = kind, name, error
        self.rolled_back = list(rolled_back)
        undone = ", ".join(f"{c.kind} {c.name}" for c in self.rolled_back)
        super().__init__(
            f"the API server refused {kind} {name}: {error.message}"
            + (f" (rolled back {undone})" if undone else "")
        )


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (the ownerReference with controller: true), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _describe(obj: Mapping[str, Any], live: Mapping[str, Any]) -> str:
    owner = next(
        (
            f"{r.get('kind')} {r.get('name')}"
            for r in (live.get("metadata") or {}).get("ownerReferences") or ()
            if r.get("controller")
        ),
        None,
    )
    whose = f"controlled by {owner}" if owner else "no owner"
    return f"{obj['kind']} {obj['metadata']['name']} exists ({whose})"


async def apply_children(
    kube: Kube,
    waves: Sequence[Sequence[Mapping[str, Any]]],
    *,
    owner_uid: str,
    field_manager: str,
    undoing: set[str] | None = None,
) -> list[Created]:
    """Look every child up, then write wave by wave. Returns what this attempt created.

    Raises ChildConflict (nothing written) or ChildRefused (what was created is deleted again; their uids
    go into ``undoing`` first, so the deletion watch does not mistake them for children deleted by hand).
    """
    objs = [o for wave in waves for o in wave]
    lives = await asyncio.gather(
        *(kube.get(str(o["kind"]), str(o["metadata"]["namespace"]), str(o["metadata"]["name"])) for o in objs)
    )
    conflicts: list[str] = []
    ours: dict[tuple[str, str], str] = {}
    for obj, live in zip(objs, lives, strict=True):
        if live is None:
            continue
        if controller_uid(live) != owner_uid:
            conflicts.append(_describe(obj, live))
        else:
            ours[(str(obj["kind"]), str(obj["metadata"]["name"]))] = str(live["metadata"]["uid"])
    if conflicts:
        raise ChildConflict(conflicts)

    created: list[Created] = []

    async def write(obj: Mapping[str, Any]) -> None:
        kind, name = str(obj["kind"]), str(obj["metadata"]["name"])
        uid = ours.get((kind, name))
        body = dict(obj)
        if uid is not None:  # converge ours, and only if it is still the object we looked at
            body["metadata"] = {**obj["metadata"], "uid": uid}
        out = await kube.apply(body, field_manager=field_manager)
        if uid is None:
            created.append(Created(kind, name, str((out.get("metadata") or {}).get("uid", ""))))

    for wave in waves:
        results = await asyncio.gather(*(write(o) for o in wave), return_exceptions=True)
        for obj, res in zip(wave, results, strict=True):
            if isinstance(res, KubeError) and res.status in REFUSED:
                await rollback(kube, created, namespace=str(obj["metadata"]["namespace"]), undoing=undoing)
                raise ChildRefused(str(obj["kind"]), str(obj["metadata"]["name"]), res, created)
            if isinstance(res, BaseException):
                await rollback(kube, created, namespace=str(obj["metadata"]["namespace"]), undoing=undoing)
                raise res
    return created


async def rollback(
    kube: Kube, created: Sequence[Created], *, namespace: str, undoing: set[str] | None = None
) -> None:
    """Delete what an attempt created, newest first, each only if it is still that object (uid)."""
    if undoing is not None:
        undoing.update(c.uid for c in created)
    for c in reversed(created):
        try:
            await kube.delete(c.kind, namespace, c.name, uid=c.uid)
        except KubeError as exc:
            if exc.status not in (404, 409):  # gone already, or replaced: not ours to delete
                raise
