"""The process layout a spec asks for: trainer ranks, rollout engines, and where each one lives.

One place answers "how many processes of which kind on which pod", for the operator (render and
apply-time refusals) and for the runtime (Ray placement). With ``gpu.vendor: cpu`` the GPU counts
count CPU ranks instead (0 meaning 1), so a CPU spec has exactly the layout of its GPU twin.
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import RLJobSpec, colocated


def _units(gpus: int | None) -> int:
    """Processes a pod runs for a GPU count: one per GPU, one on a pod without GPUs."""
    return max(gpus or 0, 1)


@dataclass(frozen=True)
class Layout:
    """Trainer ranks and rollout engines of one job and the pods they sit on.

    Trainer rank ``r`` runs on trainer pod ``r // ranks_per_pod`` (ranks of a pod are contiguous, so
    HSDP's shard groups are pods). Rollout engine ``e`` takes ``tp`` devices: in separate_async on
    rollout pod ``e // engines_per_pod``; colocated, next to trainer ranks ``[e * tp, (e + 1) * tp)``.
    """

    trainer_pods: int
    ranks_per_pod: int
    rollout_pods: int  # 0 when colocated (the engines share the trainer pods)
    units_per_rollout_pod: int
    rollout_units: int  # devices (or CPU ranks) the engines use in total
    tp: int
    colocated: bool

    @property
    def trainer_ranks(self) -> int:
        return self.trainer_pods * self.ranks_per_pod

    @property
    def engines(self) -> int:
        return self.rollout_units // self.tp

    @property
    def engines_per_pod(self) -> int:
        per = self.ranks_per_pod if self.colocated else self.units_per_rollout_pod
        return max(per // self.tp, 1)

    def trainer_pod_of(self, rank: int) -> int:
        return rank // self.ranks_per_pod

    def engine_pod_of(self, engine: int) -> int:
        """The pod (trainer pod when colocated, else rollout pod) engine ``engine`` runs on."""
        return engine // self.engines_per_pod


def layout(spec: RLJobSpec) -> Layout:
    """The spec's layout. Colocated engines use every trainer device unless
    ``rollout.replicas x rollout.gpusPerReplica`` asks for fewer (then the first ones)."""
    t, r = spec.trainer, spec.rollout
    ranks_per_pod = _units(t.gpus_per_replica)
    if colocated(spec):
        units = t.replicas * ranks_per_pod
        if r.gpus_per_replica:
            units = min(units, r.replicas * r.gpus_per_replica)
        return Layout(t.replicas, ranks_per_pod, 0, ranks_per_pod, units, r.tensor_parallel_size, True)
    per_pod = _units(r.gpus_per_replica)
    return Layout(
        t.replicas, ranks_per_pod, r.replicas, per_pod, r.replicas * per_pod, r.tensor_parallel_size, False
    )


def trainer_ranks(spec: RLJobSpec) -> int:
    """Trainer processes: ``trainer.replicas x trainer.gpusPerReplica`` (CPU ranks on vendor cpu)."""
    return layout(spec).trainer_ranks


def rollout_engines(spec: RLJobSpec) -> int:
    """Rollout engines: rollout devices / ``rollout.tensorParallelSize``."""
    return layout(spec).engines
