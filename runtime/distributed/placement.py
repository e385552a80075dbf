"""Where every trainer rank and rollout engine runs: Ray placement groups over the worker pods.

Each worker pod advertises its group's Ray resource (``rlkube_trainer``, ``rlkube_rollout`` or, when
trainer and rollout share GPUs, ``rlkube_actor``) worth its GPU count (its CPU-rank count on
vendor cpu; see ``rlkube.api.layout``), plus its GPUs. A placement group has one bundle per pod
holding that pod's whole share, so a bundle fits on exactly one pod; rank ``r`` takes bundle
``r // ranks_per_pod`` (ranks of one pod packed together, contiguous rank numbers per pod), and
each rank asks its bundle for one device. Locally, ``local_resources`` advertises the same totals
on the one node, so placement runs through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlkube.api import RLJobSpec, ray_resource_name
from rlkube.api.layout import Layout, layout


@dataclass(frozen=True)
class Placement:
    """Bundles of the job's placement groups and every actor's share of its bundle."""

    layout: Layout
    trainer_group: str  # Ray resource name of the trainer (or shared) group
    rollout_group: str
    gpus: bool  # the pods have GPUs (Ray's "GPU" resource)
    trainer_bundles: list[dict[str, float]] = field(default_factory=list)
    rollout_bundles: list[dict[str, float]] = field(default_factory=list)  # empty when colocated

    def rank_resources(self) -> dict[str, float]:
        """What one trainer rank takes from its bundle: one device (and, colocated, half the pod
        share, the engines taking the other half)."""
        res = {self.trainer_group: 0.5 if self.layout.colocated else 1.0}
        if self.gpus:
            res["GPU"] = 1.0
        return res

    def engine_resources(self) -> dict[str, float]:
        """What one engine takes from its bundle: ``tp`` devices in separate_async. Colocated, the
        devices belong to the trainer ranks (Ray would pack two half-GPU ranks onto one GPU): the
        engine takes no GPU from Ray and is pinned to its ranks' devices (:func:`engine_env`)."""
        tp = self.layout.tp
        if self.layout.colocated:
            return {self.trainer_group: 0.5 * tp}
        res = {self.rollout_group: float(tp)}
        if self.gpus:
            res["GPU"] = float(tp)
        return res

    def colocated_ranks(self, engine: int) -> range:
        """The trainer ranks whose devices a colocated engine shares."""
        tp = self.layout.tp
        return range(engine * tp, (engine + 1) * tp)

    def rank_bundle(self, rank: int) -> int:
        return self.layout.trainer_pod_of(rank)

    def engine_bundle(self, engine: int) -> int:
        return self.layout.engine_pod_of(engine)

    def local_resources(self) -> dict[str, float]:
        """The custom resources a one-node local Ray advertises (every pod's share summed)."""
        out: dict[str, float] = {}
        for b in [*self.trainer_bundles, *self.rollout_bundles]:
            for k, v in b.items():
                if k != "GPU":
                    out[k] = out.get(k, 0.0) + v
        return out


def plan_placement(spec: RLJobSpec) -> Placement:
    lay = layout(spec)
    gpus = spec.gpu.vendor != "cpu"
    if lay.colocated:
        tname = rname = ray_resource_name("actor")
    else:
        tname, rname = ray_resource_name("trainer"), ray_resource_name("rollout")

    def bundle(name: str, units: int) -> dict[str, float]:
        b = {name: float(units)}
        if gpus:
            b["GPU"] = float(units)
        return b

    trainer = [bundle(tname, lay.ranks_per_pod) for _ in range(lay.trainer_pods)]
    rollout = (
        [] if lay.colocated else [bundle(rname, lay.units_per_rollout_pod) for _ in range(lay.rollout_pods)]
    )
    return Placement(lay, tname, rname, gpus, trainer, rollout)


def create_placement_groups(p: Placement, timeout_s: float = 300.0) -> tuple[Any, Any]:
    """The trainer (or shared) and rollout placement groups, ready; raises naming what did not fit."""
    import ray
    from ray.util.placement_group import placement_group

    groups = [placement_group(p.trainer_bundles, strategy="PACK", name="rlkube-trainer")]
    if p.rollout_bundles:
        groups.append(placement_group(p.rollout_bundles, strategy="PACK", name="rlkube-rollout"))
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        raise RuntimeError(
            f"the Ray cluster cannot place the job's workers within {timeout_s:.0f} s: trainer bundles "
            f"{p.trainer_bundles}, rollout bundles {p.rollout_bundles}; cluster resources "
            f"{ray.cluster_resources()}"
        )
    return groups[0], groups[1] if len(groups) > 1 else groups[0]


def actor_options(group: Any, bundle: int, resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options placing one actor in ``bundle`` of ``group`` with ``resources``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    res = dict(resources)
    opts: dict[str, Any] = {
        "num_cpus": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle
        ),
    }
    if "GPU" in res:
        opts["num_gpus"] = res.pop("GPU")
    if res:
        opts["resources"] = res
    return opts


def engine_env(visible_var: str | None, rank_devices: list[list[str]]) -> dict[str, str]:
    """A colocated engine's visibility env: the devices of its trainer ranks (Ray leaves an actor
    that asked for no GPU alone), in the platform's visible-devices variable."""
    if visible_var is None:
        return {}
    ids = [d for devs in rank_devices for d in devs]
    return {visible_var: ",".join(ids)} if ids else {}
