"""The rendered pods are exactly what the runtime's placement groups ask for.

For the seed's 4+4 example, a colocated example, a 2-node 8+8 job, a 4-node 16+16 job and a CPU twin
of the 4+4 job:
every worker group has one pod per placement bundle, each pod's GPU limit is its bundle's GPUs and
its Ray resource (``rlkube_<group>``) is its bundle's share, so the trainer ranks (one per GPU, a
pod's ranks together) and the engines (GPUs / tensorParallelSize) land on the pods meant for them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from specs import admit_and_render, merge, minimal, separate

from rlkube.api import parse_rljob, resolve
from rlkube.api.layout import layout
from rlkube.runtime.distributed.placement import plan_placement

ROOT = Path(__file__).resolve().parents[2]


def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def eight_plus_eight() -> dict[str, Any]:
    """Two nodes: 8 trainer GPUs on one, 8 rollout GPUs (TP 2) on the other: 8 ranks, 4 engines."""
    return separate(
        trainer={"replicas": 1, "gpusPerReplica": 8},
        rollout={"replicas": 1, "gpusPerReplica": 8, "tensorParallelSize": 2},
        training={"mode": "separate_async", "trainBatchSize": 128, "miniBatchSize": 32},
    )


def sixteen_plus_sixteen() -> dict[str, Any]:
    """Four nodes: two trainer pods of 8 GPUs, two rollout pods of 8 (TP 2): 16 ranks, 8 engines."""
    return separate(
        trainer={"replicas": 2, "gpusPerReplica": 8},
        rollout={"replicas": 2, "gpusPerReplica": 8, "tensorParallelSize": 2},
        training={"mode": "separate_async", "trainBatchSize": 128, "miniBatchSize": 32},
    )


def cpu_four_plus_four() -> dict[str, Any]:
    """The 4+4 layout on CPUs: gpusPerReplica counts CPU ranks."""
    return merge(
        separate(),
        {"gpu": {"vendor": "cpu"}, "rollout": {"engine": "vllm", "gpusPerReplica": 4}},
    )


CASES = {
    "dapo-4+4": (lambda: _example("dapo-qwen25-math-7b.yaml"), 4, 4),
    "colocated-8": (lambda: _example("grpo-qwen3-8b-colocated.yaml"), None, None),
    "2-node-8+8": (eight_plus_eight, 8, 4),
    "4-node-16+16": (sixteen_plus_sixteen, 16, 8),
    "cpu-4+4": (cpu_four_plus_four, 4, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rendered_pods_carry_the_placement_bundles(case: str) -> None:
    build, ranks, engines = CASES[case]
    raw = build()
    spec = resolve(parse_rljob(raw)).spec
    plan = plan_placement(spec)
    lay = layout(spec)
    if ranks is not None:
        assert (lay.trainer_ranks, lay.engines) == (ranks, engines)
    ch = admit_and_render(raw)
    groups = {g["groupName"]: g for g in ch.ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    wanted = {"trainer": plan.trainer_bundles, "rollout": plan.rollout_bundles}
    if lay.colocated:
        wanted = {"actor": plan.trainer_bundles}
    assert set(groups) == set(wanted)
    for name, bundles in wanted.items():
        g = groups[name]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == len(bundles)
        advertised = json.loads(g["rayStartParams"]["resources"].strip("'"))
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        for b in bundles:  # every pod of a group is alike
            assert advertised == {k: int(v) for k, v in b.items() if k != "GPU"}
            gpu_limit = {k: v for k, v in limits.items() if k.endswith("gpu")}
            assert gpu_limit == ({spec.gpu.resource_name: str(int(b["GPU"]))} if "GPU" in b else {})
    # each rank and engine fits its bundle, and the bundles hold all of them
    per_rank = plan.rank_resources()
    per_engine = plan.engine_resources()
    used: dict[int, dict[str, float]] = {}
    for r in range(lay.trainer_ranks):
        for k, v in per_rank.items():
            used.setdefault(plan.rank_bundle(r), {}).setdefault(k, 0.0)
            used[plan.rank_bundle(r)][k] += v
    if lay.colocated:
        for e in range(lay.engines):
            for k, v in per_engine.items():
                used.setdefault(plan.engine_bundle(e), {}).setdefault(k, 0.0)
                used[plan.engine_bundle(e)][k] += v
    for i, b in enumerate(plan.trainer_bundles):
        assert used[i] == pytest.approx(b), (i, used[i], b)


def test_colocated_ranks_own_whole_gpus_and_engines_share_them() -> None:
    spec = resolve(parse_rljob(_example("grpo-qwen3-8b-colocated.yaml"))).spec
    plan = plan_placement(spec)
    assert plan.rank_resources()["GPU"] == 1.0  # never two ranks on one GPU
    assert "GPU" not in plan.engine_resources()  # pinned to its ranks' devices instead
    tp = plan.layout.tp
    assert list(plan.colocated_ranks(1)) == list(range(tp, 2 * tp))


def test_ranks_of_a_pod_are_contiguous_and_engines_split_rollout_pods() -> None:
    spec = resolve(parse_rljob(sixteen_plus_sixteen())).spec
    plan = plan_placement(spec)
    assert [plan.rank_bundle(r) for r in range(16)] == [0] * 8 + [1] * 8
    assert [plan.engine_bundle(e) for e in range(8)] == [0] * 4 + [1] * 4
    assert plan.engine_resources() == {"rlkube_rollout": 2.0, "GPU": 2.0}


def test_minimal_spec_is_one_rank_one_engine() -> None:
    lay = layout(resolve(parse_rljob(minimal())).spec)
    assert (lay.trainer_ranks, lay.engines) == (1, 1)
