"""A minimal, thread-safe REST client for the bring-up path.

Bringing a cluster up needs a handful of calls (readyz, create nodes/CRDs, list nodes); doing them
over keep-alive HTTPS with the standard library keeps `up` fast and free of the heavy `kubernetes`
import. Tests use the official client through the fixtures instead.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
from typing import Any
from urllib.parse import urlencode, urlsplit


def bearer_kubeconfig(server: str, token: str, ca_pem: str, user: str) -> dict[str, Any]:
    """A kubeconfig (as a dict) for `user` with a bearer token, pinned to the cluster's CA."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "rlkube-dev",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem.encode()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "rlkube-dev", "context": {"cluster": "rlkube-dev", "user": user}}],
        "current-context": "rlkube-dev",
    }


class ApiError(Exception):
    """A non-2xx answer from the API server (status and decoded body kept for callers)."""

    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path} -> {status}: {message}")
        self.status = status
        self.body = body


class KubeApi:
    """Bearer-token HTTPS client pinned to the cluster's CA; one connection per thread."""

    def __init__(self, server: str, token: str, ca_pem: str | None, timeout: float = 10.0) -> None:
        parts = urlsplit(server)
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 443
        self._token = token
        self._timeout = timeout
        if ca_pem is None:
            self._ctx = ssl._create_unverified_context()
        else:
            self._ctx = ssl.create_default_context(cadata=ca_pem)
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._ctx
            )
            self._local.conn = conn
        return conn

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        """Send one request; returns the decoded JSON (or text) body, raises ApiError on non-2xx."""
        url = path + ("?" + urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self._token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, url, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        text = raw.decode(errors="replace")
        try:
            decoded: Any = json.loads(text) if text else None
        except json.JSONDecodeError:
            decoded = text
        if not 200 <= resp.status < 300:
            raise ApiError(method, path, resp.status, decoded)
        return decoded

    def get(self, path: str, **params: str) -> Any:
        return self.request("GET", path, params=params or None)

    def create(self, path: str, body: dict) -> Any:
        """POST `body`; an AlreadyExists answer counts as success (bring-up is idempotent)."""
        try:
            return self.request("POST", path, body)
        except ApiError as err:
            if err.status == 409:
                return None
            raise

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
