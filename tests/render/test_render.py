"""The renderer: one RLJob -> the children a user's job needs, with the AMD/KubeRay details right."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from specs import EXAMPLES, UID, admit_and_render, cpu, merge, minimal, separate

from rlkube.api import InvalidRLJob, RenderDefaults, parse_rljob, resolve
from rlkube.api.models import RLJob
from rlkube.api.platform_env import ray_container_env
from rlkube.operator.render import MAX_RAYJOB_NAME, Children, ray_job_name, render_children


def render(job: dict[str, Any], defaults: RenderDefaults | None = None) -> Children:
    rendered: Children = admit_and_render(job, defaults=defaults)
    return rendered


def cluster(ch: Children) -> dict[str, Any]:
    return ch.ray_job["spec"]["rayClusterSpec"]


def groups(ch: Children) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in cluster(ch)["workerGroupSpecs"]}


def pod_specs(ch: Children) -> list[dict[str, Any]]:
    return [cluster(ch)["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in groups(ch).values()
    ]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), "an env name appears twice"
    return {e["name"]: e["value"] for e in container["env"]}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / name).read_text())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_a_correct_rayjob(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    rl = parse_rljob(raw)
    ch = render(raw)
    spec = resolve(rl).spec
    rj = ch.ray_job
    assert rj["apiVersion"] == "ray.io/v1" and rj["kind"] == "RayJob"
    assert rj["spec"]["entrypoint"] == "rlkube-train --rljob /etc/rlkube/rljob.yaml"
    assert rj["spec"]["shutdownAfterJobFinishes"] is True
    assert rj["spec"]["submissionMode"] == "K8sJobMode"

    head = cluster(ch)["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert head["rayStartParams"]["num-cpus"].isdigit()
    head_limits = head["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert not [k for k in head_limits if "gpu" in k or "/" in k], "the head must not take a GPU"

    expected = {"sync": ["actor"], "colocate_async": ["actor"], "separate_async": ["trainer", "rollout"]}
    assert list(groups(ch)) == expected[spec.training.mode]
    for name, g in groups(ch).items():
        params = g["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), params
        assert params["num-cpus"].isdigit()
        resources = json.loads(params["resources"].strip("'"))
        assert list(resources) == [f"rlkube_{name}"]
        gpus = (
            spec.trainer.gpus_per_replica if name in ("actor", "trainer") else spec.rollout.gpus_per_replica
        )
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        if spec.gpu.vendor == "cpu":
            assert params["num-gpus"] == "0"
            assert not [k for k in limits if k not in ("cpu", "memory")]
        else:
            assert limits[spec.gpu.resource_name] == str(gpus)
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"]

    platform = ray_container_env(spec.gpu.vendor, spec.rollout.engine)
    user = {e.name: e.value for e in spec.env}
    for pod in pod_specs(ch):
        ray = pod["containers"][0]
        env = env_of(ray)
        for k, v in platform.items():
            assert env[k] == user.get(k, v)
        assert "ROCR_VISIBLE_DEVICES" not in env
        assert env["RLKUBE_RLJOB_NAME"] == rl.name and env["RLKUBE_RLJOB_NAMESPACE"] == "ns"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and volumes["dshm"]["emptyDir"]["sizeLimit"]
        assert volumes["rljob-config"]["configMap"]["name"] == ch.config_map["metadata"]["name"]
        mounts = {m["mountPath"]: m["name"] for m in ray["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm" and mounts["/etc/rlkube"] == "rljob-config"
        assert pod["serviceAccountName"] == ch.service_account["metadata"]["name"]
        for value in params.values():
            assert isinstance(value, str)


def test_amd_env_on_every_container_and_never_rocr() -> None:
    ch = render(minimal())
    for pod in pod_specs(ch):
        env = env_of(pod["containers"][0])
        assert env["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"
        assert env["RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES"] == "1"
        assert env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"
        assert env["HSA_NO_SCRATCH_RECLAIM"] == "1"
        assert "ROCR_VISIBLE_DEVICES" not in env


def test_sglang_on_amd_gets_triton_attention_and_no_aiter() -> None:
    ch = render(merge(minimal(), {"rollout": {"engine": "sglang"}}))
    for pod in pod_specs(ch):
        env = env_of(pod["containers"][0])
        assert env["SGLANG_ATTENTION_BACKEND"] == "triton" and env["SGLANG_USE_AITER"] == "0"


def test_user_env_wins_over_platform_and_admin_defaults() -> None:
    job = merge(
        minimal(), {"env": [{"name": "NCCL_MIN_NCHANNELS", "value": "32"}, {"name": "X", "value": "user"}]}
    )
    defaults = RenderDefaults(extra_env={"X": "admin", "Y": "admin"})
    for pod in pod_specs(render(job, defaults)):
        env = env_of(pod["containers"][0])
        assert (env["NCCL_MIN_NCHANNELS"], env["X"], env["Y"]) == ("32", "user", "admin")


def test_rocr_in_user_env_is_refused_and_nothing_is_rendered() -> None:
    with pytest.raises(InvalidRLJob) as exc:
        render(merge(minimal(), {"env": [{"name": "ROCR_VISIBLE_DEVICES", "value": "0,1"}]}))
    assert [e.field for e in exc.value.errors] == ["spec.env"]
    assert "ROCR_VISIBLE_DEVICES" in str(exc.value)


def test_the_renderer_takes_only_a_resolved_job() -> None:
    job = parse_rljob(minimal())
    job = job.model_copy(update={"metadata": {**job.metadata, "uid": UID}})
    with pytest.raises(ValueError, match="resolve"):
        render_children(job)
    assert render_children(resolve(job)).ray_job["metadata"]["name"] == "job"


def test_rocr_from_admin_defaults_is_dropped() -> None:
    ch = render(minimal(), RenderDefaults(extra_env={"ROCR_VISIBLE_DEVICES": "0"}))
    assert all("ROCR_VISIBLE_DEVICES" not in env_of(p["containers"][0]) for p in pod_specs(ch))


def test_nvidia_renders_cuda_resource_and_env() -> None:
    ch = render(merge(minimal(), {"gpu": {"vendor": "nvidia"}, "trainer": {"gpusPerReplica": 2}}))
    actor = groups(ch)["actor"]
    assert actor["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert actor["template"]["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    env = env_of(actor["template"]["spec"]["containers"][0])
    assert env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] == "1"
    assert "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES" not in env
    assert "num-gpus" not in actor["rayStartParams"]  # KubeRay derives it from nvidia.com/gpu


def test_amd_partition_resource_gets_explicit_num_gpus() -> None:
    ch = render(
        merge(minimal(), {"gpu": {"resourceName": "amd.com/cpx_nps4"}, "trainer": {"gpusPerReplica": 8}})
    )
    actor = groups(ch)["actor"]
    assert actor["rayStartParams"]["num-gpus"] == "8"
    assert actor["template"]["spec"]["containers"][0]["resources"]["limits"]["amd.com/cpx_nps4"] == "8"


def test_whole_amd_gpus_leave_num_gpus_to_kuberay() -> None:
    ch = render(merge(minimal(), {"trainer": {"gpusPerReplica": 8}}))
    assert "num-gpus" not in groups(ch)["actor"]["rayStartParams"]


def test_cpu_vendor_has_no_gpu_anywhere() -> None:
    ch = render(cpu())
    actor = groups(ch)["actor"]
    assert actor["rayStartParams"]["num-gpus"] == "0"
    assert set(actor["template"]["spec"]["containers"][0]["resources"]["limits"]) == {"cpu", "memory"}
    assert "tolerations" not in actor["template"]["spec"]
    assert json.loads(actor["rayStartParams"]["resources"].strip("'")) == {"rlkube_actor": 1}


def test_separate_async_groups_advertise_their_own_ray_resource() -> None:
    ch = render(separate(rollout={"replicas": 2, "gpusPerReplica": 2}))
    g = groups(ch)
    assert json.loads(g["trainer"]["rayStartParams"]["resources"].strip("'")) == {"rlkube_trainer": 4}
    assert json.loads(g["rollout"]["rayStartParams"]["resources"].strip("'")) == {"rlkube_rollout": 2}
    assert g["rollout"]["replicas"] == 2
    # KubeRay refuses group-level `resources` next to rayStartParams num-cpus/resources.
    assert "resources" not in g["trainer"] and "resources" not in g["rollout"]


def test_gpu_placement_from_spec() -> None:
    job = merge(
        minimal(),
        {
            "gpu": {
                "productName": "AMD_Instinct_MI300X",
                "nodeSelector": {"pool": "rl"},
                "tolerations": [
                    {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
                ],
            }
        },
    )
    ch = render(job)
    pod = groups(ch)["actor"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "rl", "amd.com/gpu.product-name": "AMD_Instinct_MI300X"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}
    ]
    head = cluster(ch)["headGroupSpec"]["template"]["spec"]
    assert "tolerations" not in head and "nodeSelector" not in head


def test_checkpoint_claim_only_on_the_training_group() -> None:
    ch = render(separate(checkpoint={"persistentVolumeClaim": "ckpt"}))
    claims = {
        name: [v for v in g["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
        for name, g in groups(ch).items()
    }
    assert [v["persistentVolumeClaim"]["claimName"] for v in claims["trainer"]] == ["ckpt"]
    assert claims["rollout"] == []


def test_user_mounts_on_every_pod() -> None:
    ch = render(
        merge(
            minimal(), {"mounts": [{"name": "models", "persistentVolumeClaim": "m", "mountPath": "/models"}]}
        )
    )
    for pod in pod_specs(ch):
        assert {"name": "models", "persistentVolumeClaim": {"claimName": "m", "readOnly": True}} in pod[
            "volumes"
        ]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in pod["containers"][0][
            "volumeMounts"
        ]


def test_every_child_is_owned_and_labelled() -> None:
    ch = render(minimal())
    assert [c["kind"] for c in ch.all()] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "RayJob"]
    for child in ch.all():
        meta = child["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "rlkube"
        assert meta["labels"]["rlkube.io/rljob"] == "job"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "rlkube.io/v1alpha1",
                "kind": "RLJob",
                "name": "job",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_runtime_rbac_reaches_only_this_rljob_status() -> None:
    ch = render(minimal())
    assert ch.service_account["metadata"]["name"] == "job-runtime"
    rules = ch.role["rules"]
    assert rules == [
        {
            "apiGroups": ["rlkube.io"],
            "resources": ["rljobs/status"],
            "resourceNames": ["job"],
            "verbs": ["patch"],
        },
    ]
    binding = ch.role_binding
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "job-runtime",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "job-runtime", "namespace": "ns"}]


def test_configmap_holds_the_resolved_spec_the_entrypoint_reads() -> None:
    job = separate()
    ch = render(job)
    text = ch.config_map["data"]["rljob.yaml"]
    back = parse_rljob(yaml.safe_load(text))
    expected = resolve(RLJob.model_validate({**job, "metadata": {**job["metadata"], "uid": UID}}))
    assert back == expected
    assert back.spec.async_ is not None and back.spec.gpu.resource_name == "amd.com/gpu"


def test_lifecycle_fields_pass_to_the_rayjob() -> None:
    job = merge(
        minimal(),
        {"suspend": True, "activeDeadlineSeconds": 3600, "backoffLimit": 2, "ttlSecondsAfterFinished": 300},
    )
    ch = render(job)
    spec = ch.ray_job["spec"]
    assert (
        spec["suspend"],
        spec["activeDeadlineSeconds"],
        spec["backoffLimit"],
        spec["ttlSecondsAfterFinished"],
    ) == (
        True,
        3600,
        2,
        300,
    )
    assert ch.manage_suspend is True


def test_kueue_labels_pass_through_and_suspend_is_left_to_kueue() -> None:
    job = merge(minimal(), {"suspend": True})
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "gpu-queue", "team": "rl"}
    ch = render(job)
    labels = ch.ray_job["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert "team" not in labels
    assert "suspend" not in ch.ray_job["spec"]
    assert ch.manage_suspend is False
    assert ch.warnings


def test_render_defaults_feed_image_head_and_pull_secrets_but_the_spec_wins() -> None:
    defaults = RenderDefaults.model_validate(
        {
            "image": "registry.local/rlkube:1",
            "imagePullPolicy": "Always",
            "imagePullSecrets": ["regcred"],
            "headCpu": 4,
        }
    )
    ch = render(minimal(), defaults)
    head = cluster(ch)["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "4"
    for pod in pod_specs(ch):
        assert pod["containers"][0]["image"] == "registry.local/rlkube:1"
        assert pod["containers"][0]["imagePullPolicy"] == "Always"
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    mine = render(merge(minimal(), {"image": "me/img:2", "head": {"cpu": 1}}), defaults)
    assert {p["containers"][0]["image"] for p in pod_specs(mine)} == {"me/img:2"}
    assert cluster(mine)["headGroupSpec"]["rayStartParams"]["num-cpus"] == "1"


def test_default_image_follows_the_vendor() -> None:
    assert {p["containers"][0]["image"] for p in pod_specs(render(cpu()))} == {"rlkube/runtime-cpu:0.1.0"}
    assert {p["containers"][0]["image"] for p in pod_specs(render(minimal()))} == {
        "rlkube/runtime-rocm:0.1.0"
    }


@pytest.mark.parametrize(
    "name",
    ["short", "a" * 47, "a" * 63, "9lives", "dots.in.name", "x" * 40 + "-" + "y" * 20],
)
def test_rayjob_names_fit_kuberay_and_are_stable(name: str) -> None:
    out = ray_job_name(name)
    assert len(out) <= MAX_RAYJOB_NAME
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", out)
    assert ray_job_name(name) == out
    if len(name) <= MAX_RAYJOB_NAME and name[0].isalpha() and "." not in name:
        assert out == name


def test_long_names_that_share_a_prefix_get_different_rayjobs() -> None:
    a, b = "p" * 50 + "-one", "p" * 50 + "-two"
    assert ray_job_name(a) != ray_job_name(b)
    job = minimal()
    job["metadata"]["name"] = a
    assert render(job).ray_job["metadata"]["name"] == ray_job_name(a)


def test_no_rljob_can_be_named_after_another_ones_hashed_rayjob() -> None:
    """Issue 12: RLJob `col.a` got RayJob `col-a-392f9a72`; an RLJob literally named that took it over."""
    hashed = ray_job_name("col.a")
    assert hashed != "col.a" and re.fullmatch(r"col-a-[0-9a-f]{16}", hashed)
    assert ray_job_name(hashed) != hashed  # the look-alike is hashed in turn, to a different name
    assert ray_job_name("col-a-392f9a72") == "col-a-392f9a72"  # 8 hex is no hash of ours: kept as is
    names = ["col.a", "col-a", hashed, "col..a", "col-a.b", "9col", "r-9col"]
    assert len({ray_job_name(n) for n in names}) == len(names)


def test_cpu_overcommit_and_head_placement_reach_the_submitter_too() -> None:
    """A small shared node: requests at a fraction of the limits (Ray still sees the limit as its
    CPUs), and KubeRay's submitter pod goes where the head goes, with small requests of its own."""
    toleration = {"key": "rlkube.io/real-node", "operator": "Exists", "effect": "NoSchedule"}
    defaults = RenderDefaults.model_validate(
        {"cpuRequestPercent": 25, "headNodeSelector": {"pool": "cpu"}, "headTolerations": [toleration]}
    )
    ch = render(cpu(), defaults)
    head = cluster(ch)["headGroupSpec"]
    res = head["template"]["spec"]["containers"][0]["resources"]
    cpus = int(res["limits"]["cpu"])
    assert res["requests"]["cpu"] == f"{cpus * 250}m" and head["rayStartParams"]["num-cpus"] == str(cpus)
    for group in groups(ch).values():
        r = group["template"]["spec"]["containers"][0]["resources"]
        assert r["requests"]["cpu"] == f"{int(r['limits']['cpu']) * 250}m"
    assert head["template"]["spec"]["tolerations"] == [toleration]
    sub = ch.ray_job["spec"]["submitterPodTemplate"]["spec"]
    assert sub["nodeSelector"] == {"pool": "cpu"} and sub["tolerations"] == [toleration]
    assert sub["restartPolicy"] == "Never"
    assert sub["containers"][0]["image"] == head["template"]["spec"]["containers"][0]["image"]
    # Without the admin setting, requests equal limits (no overcommit).
    plain = cluster(render(cpu()))["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]
    assert plain["requests"]["cpu"] == plain["limits"]["cpu"]
