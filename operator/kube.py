"""A small async Kubernetes client for the few calls the operator makes itself.

Kopf owns watching and its own bookkeeping patches; this module owns server-side apply of children,
status merge-patches and Events. Both share one aiohttp session (see :func:`make_session`), so every
request the operator process makes, Kopf's included, is counted in ``rlkube_api_requests_total``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import kopf

from rlkube.api.contract import API_VERSION, KIND, PLURAL

from . import metrics

USER_AGENT = "rlkube-operator/0.1.0"

# kind -> (apiVersion, plural) for everything the operator writes.
PLURALS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("v1", "configmaps"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Event": ("v1", "events"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "RayJob": ("ray.io/v1", "rayjobs"),
    "RayCluster": ("ray.io/v1", "rayclusters"),
    KIND: (API_VERSION, PLURAL),
}


class KubeError(Exception):
    """A non-2xx answer, with the API server's own message."""

    def __init__(self, status: int, method: str, url: str, body: str) -> None:
        self.status = status
        try:
            self.message = str(json.loads(body).get("message", body))
        except ValueError:
            self.message = body
        super().__init__(f"{method} {url}: {status} {self.message}")


def _resource_parts(path: str) -> list[str] | None:
    """``/apis/g/v/namespaces/ns/rayjobs/x/status`` -> ``[rayjobs, x, status]``; None for non-API paths."""
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"]:
        parts = parts[2:]
    elif parts[:1] == ["apis"]:
        parts = parts[3:]
    else:
        return None
    if parts[:1] == ["namespaces"] and len(parts) > 2:
        parts = parts[2:]
    return parts


def resource_of(path: str) -> str:
    """``/apis/ray.io/v1/namespaces/ns/rayjobs/x/status`` -> ``rayjobs/status`` (a low-cardinality label)."""
    parts = _resource_parts(path)
    if parts is None:
        first = [p for p in path.split("/") if p][:1]
        return first[0] if first else ""
    if not parts:
        return ""
    return parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")


def is_collection(path: str) -> bool:
    """True for a list URL (``.../namespaces/ns/rayjobs``), False for one object or a subresource."""
    return len(_resource_parts(path) or ()) == 1


def request_verb(method: str, path: str, query: str) -> str:
    """The apiserver's own verb names: WATCH and LIST apart from GET, else the HTTP method."""
    if "watch=true" in query or "watch=1" in query:
        return "WATCH"
    if method == "GET" and is_collection(path):
        return "LIST"
    return method


async def _on_request_end(
    session: aiohttp.ClientSession, ctx: SimpleNamespace, params: aiohttp.TraceRequestEndParams
) -> None:
    url = urlsplit(str(params.url))
    verb = request_verb(params.method, url.path, url.query or "")
    metrics.API_REQUESTS.labels(verb, resource_of(url.path), str(params.response.status)).inc()


def make_session(info: kopf.ConnectionInfo) -> aiohttp.ClientSession:
    """One counted session built from Kopf's connection info (kubeconfig or in-cluster token)."""
    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(_on_request_end)
    headers = dict(info.as_http_headers())
    headers["User-Agent"] = USER_AGENT
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ssl=info.as_ssl_context()),
        headers=headers,
        trace_configs=[trace],
    )


def object_url(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{ns}/{plural}" + (f"/{name}" if name else "")


class Kube:
    """The operator's own calls, all on the shared session."""

    def __init__(self, session: aiohttp.ClientSession, server: str) -> None:
        self.session = session
        self.server = server.rstrip("/")

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any] | None:
        url = self.server + path
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self.session.request(method, url, data=data, params=params, headers=headers) as resp:
            text = await resp.text()
            if resp.status == 404 and method == "GET":
                return None
            if resp.status >= 300:
                raise KubeError(resp.status, method, path, text)
            return json.loads(text) if text else None

    async def apply(
        self, obj: Mapping[str, Any], *, field_manager: str, force: bool = True
    ) -> dict[str, Any]:
        """Server-side apply: create or converge, owning only the fields in ``obj``."""
        api_version, plural = PLURALS[str(obj["kind"])]
        meta = obj["metadata"]
        path = object_url(api_version, plural, meta.get("namespace"), meta["name"])
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        out = await self._call(
            "PATCH", path, body=obj, params=params, content_type="application/apply-patch+yaml"
        )
        return out or {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        api_version, plural = PLURALS[kind]
        return await self._call("GET", object_url(api_version, plural, namespace, name))

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str) -> None:
        """Delete one object, only if it is still the one with ``uid`` (409 otherwise)."""
        api_version, plural = PLURALS[kind]
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        body["propagationPolicy"] = "Background"
        await self._call("DELETE", object_url(api_version, plural, namespace, name), body=body)

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """JSON merge patch of the status subresource: keys we do not send (``progress``) stay as they are."""
        api_version, plural = PLURALS[kind]
        path = object_url(api_version, plural, namespace, name) + "/status"
        await self._call("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")

    async def post_event(
        self,
        involved: Mapping[str, Any],
        *,
        type_: str,
        reason: str,
        message: str,
        now: str,
        component: str = "rlkube-operator",
    ) -> None:
        """A core/v1 Event on ``involved`` (an object body with apiVersion/kind/metadata)."""
        meta = involved["metadata"]
        ns = meta["namespace"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": ns},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": ns,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._call("POST", object_url("v1", "events", ns), body=event)
