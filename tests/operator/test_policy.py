"""The admin policy's Python enforcer (no cluster): what it refuses, in which words, and that the chart's
defaults and generated admission validations are the ones this module defines. The same specs meet the
real admission policy in tests/chart/test_chart_security.py
(test_admission_and_operator_enforce_the_same_policy_in_the_same_words)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from optest_helpers import small_rljob

from rlkube.api.models import RLJob
from rlkube.operator.policy import (
    VALIDATIONS_FILE,
    Policy,
    PolicySet,
    allowed,
    check_policy,
    host_path_allowed,
    load_policy,
    render_validations,
)

REPO = Path(__file__).resolve().parents[2]


def spec_of(**spec: Any) -> Any:
    return RLJob.model_validate(small_rljob("p", **spec)).spec


ATTACK = {
    "serviceAccountName": "powerful",
    "priorityClassName": "system-node-critical",
    "gpu": {"tolerations": [{"operator": "Exists"}]},
    "mounts": [{"name": "root", "mountPath": "/host", "hostPath": "/", "readOnly": False}],
}


def test_the_issue_attack_is_refused_field_by_field_naming_the_policy() -> None:
    errors = {e.field: e.message for e in check_policy(spec_of(**ATTACK), Policy(), "default")}
    assert set(errors) == {
        "spec.serviceAccountName",
        "spec.priorityClassName",
        "spec.gpu.tolerations",
        "spec.mounts[root].hostPath",
    }
    assert errors["spec.serviceAccountName"].startswith(
        '"powerful" is not allowed by the rlkube admin policy (default: serviceAccounts allows none)'
    )
    assert "(default: priorityClasses allows none)" in errors["spec.priorityClassName"]
    assert errors["spec.gpu.tolerations"].startswith("a toleration of every taint (no key) is not allowed")
    assert "tolerationKeys allows amd.com/*, nvidia.com/*" in errors["spec.gpu.tolerations"]
    assert "(default: hostPath.enabled is false)" in errors["spec.mounts[root].hostPath"]


def test_an_allowed_host_path_must_be_listed_and_read_only_unless_the_admin_says_so() -> None:
    pol = Policy.model_validate({"hostPath": {"enabled": True, "paths": ["/data/"]}})
    ok = spec_of(mounts=[{"name": "d", "mountPath": "/d", "hostPath": "/data/gsm8k"}])
    assert check_policy(ok, pol, "default") == []
    root = spec_of(**ATTACK)
    errors = {e.field: e.message for e in check_policy(root, pol, "default")}
    assert errors["spec.mounts[root].hostPath"].startswith('"/" is not allowed')
    assert "hostPath.paths allows /data/" in errors["spec.mounts[root].hostPath"]
    assert errors["spec.mounts[root].readOnly"].startswith(
        'a writable node directory "/" is not allowed by the rlkube admin policy (default: '
        "hostPath.writablePaths allows none); set readOnly: true"
    )
    writable = Policy.model_validate({"hostPath": {"enabled": True, "paths": ["/"], "writablePaths": ["/"]}})
    assert [e.field for e in check_policy(root, writable, "x")] == [
        "spec.serviceAccountName",
        "spec.priorityClassName",
        "spec.gpu.tolerations",
    ]


def test_writable_host_paths_are_only_those_the_admin_lists() -> None:
    """What `make demo` asks for: the task folder read-only, only its outputs folder writable."""
    pol = Policy.model_validate(
        {"hostPath": {"enabled": True, "paths": ["/tmp/demo"], "writablePaths": ["/tmp/demo/outputs"]}}
    )

    def mounts(path: str, read_only: bool) -> Any:
        return spec_of(mounts=[{"name": "m", "mountPath": "/m", "hostPath": path, "readOnly": read_only}])

    assert check_policy(mounts("/tmp/demo", True), pol, "default") == []
    assert check_policy(mounts("/tmp/demo/outputs/run1", False), pol, "default") == []
    (refused,) = check_policy(mounts("/tmp/demo", False), pol, "default")
    assert refused.field == "spec.mounts[m].readOnly"
    assert "(default: hostPath.writablePaths allows /tmp/demo/outputs)" in refused.message
    escape = check_policy(mounts("/tmp/demo/outputs/../model", False), pol, "default")
    assert [e.field for e in escape] == ["spec.mounts[m].hostPath", "spec.mounts[m].readOnly"]


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("/data", True),
        ("/data/", True),
        ("/data/a/b", True),
        ("/database", False),
        ("/data/../etc", False),
        ("/data/..", False),
        ("/data/..x", True),
        ("data/a", False),
        ("/", False),
    ],
)
def test_host_paths_are_matched_by_directory_not_by_string_prefix(path: str, ok: bool) -> None:
    assert host_path_allowed(["/data/"], path) is ok


def test_allow_lists_are_exact_names_or_star_prefixes() -> None:
    assert allowed(["a"], "a") and not allowed(["a"], "ab")
    assert allowed(["NCCL_*"], "NCCL_IB_HCA") and not allowed(["NCCL_*"], "LD_PRELOAD")
    assert allowed(["*"], "") and not allowed([], "x")
    assert allowed(["registry.example.com/*"], "registry.example.com/rl:1")
    assert not allowed(["registry.example.com/*"], "registry.example.com.evil.io/rl:1")


def test_images_env_pvc_and_node_selectors_follow_their_lists() -> None:
    pol = Policy.model_validate(
        {"images": ["registry.example.com/*"], "envNames": ["NCCL_*"], "persistentVolumeClaims": False}
    )
    spec = spec_of(
        image="docker.io/evil:1",
        env=[{"name": "NCCL_IB_HCA", "value": "x"}, {"name": "LD_PRELOAD", "value": "/x.so"}],
        mounts=[{"name": "m", "mountPath": "/m", "persistentVolumeClaim": "models"}],
        checkpoint={"persistentVolumeClaim": "ckpt"},
        gpu={"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}},
    )
    errors = {e.field: e.message for e in check_policy(spec, pol, "namespaces.team-a")}
    assert set(errors) == {
        "spec.image",
        "spec.env[LD_PRELOAD]",
        "spec.mounts[m].persistentVolumeClaim",
        "spec.checkpoint.persistentVolumeClaim",
        "spec.gpu.nodeSelector",
    }
    assert "(namespaces.team-a: images allows registry.example.com/*)" in errors["spec.image"]
    assert errors["spec.gpu.nodeSelector"].startswith('label key "node-role.kubernetes.io/control-plane"')


def test_a_namespace_policy_replaces_the_default_there_only() -> None:
    ps = PolicySet.model_validate({"namespaces": {"team-a": {"serviceAccounts": ["trainer"]}}})
    scope, pol = ps.for_namespace("team-a")
    assert scope == "namespaces.team-a" and pol.service_accounts == ["trainer"]
    assert ps.for_namespace("team-b") == ("default", ps.default)
    assert check_policy(spec_of(serviceAccountName="trainer"), pol, scope) == []


def test_the_charts_default_policy_is_the_operators_default(tmp_path: Path) -> None:
    values = yaml.safe_load((REPO / "charts" / "rlkube" / "values.yaml").read_text())
    assert Policy.model_validate(values["policy"]["default"]) == Policy()
    assert load_policy(None) == PolicySet()
    path = tmp_path / "policy.yaml"
    path.write_text("default: {serviceAccounts: [a]}\n")
    assert load_policy(path).default.service_accounts == ["a"]
    path.write_text("default: {serviceAcounts: [a]}\n")
    with pytest.raises(ValueError, match="serviceAcounts"):
        load_policy(path)  # a typo in the admin's file stops the operator instead of allowing all


def test_generated_admission_validations_are_up_to_date() -> None:
    assert VALIDATIONS_FILE.read_text() == render_validations(), "run `make crds`"
