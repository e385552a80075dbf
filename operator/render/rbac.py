"""The runtime's RBAC children: a ServiceAccount, and a Role + RoleBinding reaching only this RLJob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlkube.api.contract import GROUP, PLURAL

from .names import child_name
from .objects import Owner, object_meta


@dataclass(frozen=True)
class RuntimeRbac:
    service_account: dict[str, Any]
    role: dict[str, Any]
    role_binding: dict[str, Any]


def runtime_rbac_name(owner: Owner) -> str:
    return child_name(owner.name, "runtime")


def render_runtime_rbac(owner: Owner, service_account: str) -> RuntimeRbac:
    """`<name>-runtime`: patch on this RLJob's status (the runtime's progress pushes), nothing else.

    The pusher only ever merge-patches ``status.progress``, so no get: what the operator must hold to
    grant this (RBAC lets it grant only what it has) stays as small as the runtime's need.

    The binding names `service_account`, which is `<name>-runtime` unless spec.serviceAccountName
    picks the user's own (the ServiceAccount child is rendered either way).
    """
    name = runtime_rbac_name(owner)
    role_rules = [
        {
            "apiGroups": [GROUP],
            "resources": [f"{PLURAL}/status"],
            "resourceNames": [owner.name],
            "verbs": ["patch"],
        },
    ]
    return RuntimeRbac(
        service_account={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": object_meta(name, owner)},
        role={
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": object_meta(name, owner),
            "rules": role_rules,
        },
        role_binding={
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": object_meta(name, owner),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": owner.namespace}],
        },
    )
