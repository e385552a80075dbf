"""One trainer rank's models: the actor (+ reference, critic), their shard of every batch, and
their share of weight sync and checkpoints.

Every rank of the job holds a ``Learner`` and runs the same calls in the same order (FSDP2 is
SPMD): rank 0's :class:`~rlkube.runtime.trainer.core.Trainer` decides what each rank gets
(``rlkube.runtime.distributed.ranks`` fans the calls out) and keeps the algorithm state (prompts,
rewards, advantages, versions). With one rank there is no process group and nothing to fan out:
the same code runs in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlkube.runtime.trainer.batch import Batch
from rlkube.runtime.trainer.critic import CriticWorker
from rlkube.runtime.trainer.policy import PolicyWorker
from rlkube.runtime.trainer.worker import LossConfig, OptimConfig

if TYPE_CHECKING:  # the API (pydantic) is not needed to run a Learner built from workers
    from rlkube.api import RLJobSpec


def loss_config(spec: RLJobSpec) -> LossConfig:
    a = spec.algorithm
    return LossConfig(
        clip_low=a.clip_ratio_low,
        clip_high=a.clip_ratio_high,
        clip_c=a.clip_ratio_c if a.clip_ratio_c > 1.0 else None,
        policy_loss=a.effective_policy_loss,
        agg_mode=a.effective_loss_aggregation,
        # verl pads every response to data.maxResponseLength, so that is its default Dr. GRPO H;
        # batches here are padded to their longest response only: pass H explicitly.
        norm_constant=float(spec.data.max_response_length),
        entropy_coeff=a.entropy_coeff,
        use_kl_loss=a.kl.use_kl_loss,
        kl_loss_coef=a.kl.kl_loss_coef,
        kl_loss_type=a.kl.kl_loss_type,
        temperature=a.temperature if a.temperature > 0 else 1.0,
    )


def optim_config(spec: RLJobSpec, lr: float) -> OptimConfig:
    t = spec.training
    return OptimConfig(
        lr=lr,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        total_steps=t.total_steps,
        schedule=t.lr_schedule,
        grad_clip=t.grad_clip,
    )


def wire_dtype(spec: RLJobSpec, device: torch.device) -> torch.dtype:
    """The engines' dtype, what weights travel as (fp32 on the CPU, the model dtype on GPUs)."""
    wire = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return wire[spec.model.dtype] if device.type != "cpu" else torch.float32


class Learner:
    """The models of one trainer rank (see the module docstring)."""

    def __init__(self, spec: RLJobSpec, *, device: str | None = None) -> None:
        from rlkube.api.algorithms import CRITIC_ESTIMATORS
        from rlkube.runtime.rollout.registry import model_config_overrides
        from rlkube.runtime.trainer.core import check_model_dir
        from rlkube.runtime.weights import WeightSender

        check_model_dir("model.path", spec.model.path)  # a UserError naming the field, not a hub lookup
        a, t = spec.algorithm, spec.training
        torch.manual_seed(t.seed)
        self.loss_cfg = loss_config(spec)
        common: dict[str, Any] = {
            "loss": self.loss_cfg,
            "device": device,
            "bf16": None if spec.model.dtype == "bfloat16" else False,
            "micro_batch_size": t.micro_batch_size,
            "micro_batch_tokens": t.micro_batch_tokens,
            # HSDP: shard within each trainer pod, replicate across pods
            "replicate": spec.trainer.replicas if spec.trainer.hybrid_shard else 1,
            "config_overrides": model_config_overrides(spec),  # model.maxPositionEmbeddings
        }
        path = spec.model.path
        self.actor = PolicyWorker(
            path,
            optim=optim_config(spec, t.learning_rate),
            gradient_checkpointing=spec.model.gradient_checkpointing,
            **common,
        )
        self.rank, self.world_size = self.actor.rank, self.actor.world_size
        self.device = self.actor.device
        self.ref = (
            PolicyWorker(path, trainable=False, **common) if a.kl.use_kl_loss or a.kl.in_reward else None
        )
        self.critic = (
            CriticWorker(path, optim=optim_config(spec, t.critic_learning_rate), **common)
            if a.effective_advantage_estimator in CRITIC_ESTIMATORS
            else None
        )
        self.sender = WeightSender(
            bucket_megabytes=spec.weight_sync.bucket_megabytes, dtype=wire_dtype(spec, self.device)
        )
        self.weights: dict[int, Any] = {}  # source rank -> its weight group, once joined
        self._store: Any = None  # rank 0: the store the weight groups meet in

    @classmethod
    def from_workers(
        cls,
        actor: PolicyWorker,
        sender: Any,
        ref: PolicyWorker | None = None,
        critic: CriticWorker | None = None,
    ) -> Learner:
        """A Learner around workers built elsewhere (benchmarks: in-memory models, no spec)."""
        self = cls.__new__(cls)
        self.loss_cfg = actor.loss_cfg
        self.actor, self.ref, self.critic, self.sender = actor, ref, critic, sender
        self.rank, self.world_size, self.device = actor.rank, actor.world_size, actor.device
        self.weights, self._store = {}, None
        return self

    # -- the step ----------------------------------------------------------------------------
    def prepare(
        self, shard: Batch, *, old: bool, ref: bool, values: bool, raw: bool = False
    ) -> dict[str, Any]:
        """This rank's pre-update passes: old log-probs (and at temperature 1 with ``raw``, what
        rollout correction compares with the engines'), reference log-probs, values (CPU tensors)."""
        out: dict[str, Any] = {"timing": {}}
        if old:
            t0 = time.perf_counter()
            out["old_logp"], _ = self.actor.compute_logprobs(shard)
            if raw:
                out["raw_logp"], _ = self.actor.compute_logprobs(shard, temperature=1.0)
            out["timing"]["old_log_prob"] = time.perf_counter() - t0
        if ref and self.ref is not None:
            t0 = time.perf_counter()
            out["ref_logp"], _ = self.ref.compute_logprobs(shard)
            out["timing"]["ref"] = time.perf_counter() - t0
        if values and self.critic is not None:
            out["values"] = self.critic.compute_values(shard)
        return out

    def update(
        self, shard: Batch, num_mini: int, epochs: int, step_lr: bool
    ) -> tuple[dict[str, float], Tensor | None]:
        """Critic then actor updates over this rank's rows; metrics are global (reduced over ranks).

        Returns the metrics and, for an on-policy update, the detached log-probs of its forward
        pass in ``shard``'s row order (the old log-probs it used).
        """
        metrics: dict[str, float] = {}
        if self.critic is not None:
            metrics.update(self.critic.update(shard, num_mini, epochs))
            if step_lr:
                self.critic.lr_step()
        metrics.update(self.actor.update(shard, num_mini, epochs))
        if step_lr:
            self.actor.lr_step()
        return metrics, self.actor.last_update_logp

    # -- weights -----------------------------------------------------------------------------
    def full_named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named full tensors; with FSDP2 every rank must iterate together (each is a gather)."""
        return self.actor.full_named_parameters()

    def sharded_named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named parameters as this rank holds them (DTensor shards under FSDP2), skipping
        replicas another rank sends (HSDP)."""
        from rlkube.runtime.weights import is_sending_replica

        for name, p in self.actor.model.state_dict().items():
            if is_sending_replica(p):
                yield name, p.detach()

    def iterate_full_parameters(self) -> int:
        """Take part in a gather of every full tensor without keeping them (peers of a rank-0 full
        sync: FSDP2's all-gathers need every rank); returns how many were gathered."""
        return sum(1 for _ in self.full_named_parameters())

    def delta_buckets(self, version: int) -> list[Any]:
        """This rank's delta of its own shard as buckets (for transports that gather them)."""
        return list(self.sender.delta(self.sharded_named_parameters(), version))

    def join_weight_groups(self, specs: list[Any]) -> None:
        """Join the weight group this rank sends on (if any) as its rank 0; rank 0 also hosts the
        store every group meets in. Blocks until each joined group is complete."""
        from rlkube.runtime.weights.collective import join_weight_group, open_store

        if not specs:
            return
        first = specs[0]
        self._store = open_store(first.host, first.port, is_master=self.rank == 0, timeout_s=first.timeout_s)
        dev = self.device if first.backend == "nccl" else None
        self.weights = {
            s.source: join_weight_group(self._store, s, 0, dev) for s in specs if s.source == self.rank
        }

    def send_weights(self, version: int, method: str) -> dict[str, float]:
        """This rank's part of a sync over the weight groups; returns its sender's statistics.

        ``full``: rank 0 streams the full tensors, gathered from the FSDP2 shards one parameter at
        a time (the other ranks take part in each gather); ``delta_sharded``: every rank streams
        the changed (position, value) pairs of its own shard on its own group.
        """
        from rlkube.runtime.weights.collective import send_stream

        if method == "full":
            if self.rank != 0:
                self.iterate_full_parameters()
                return {}
            send_stream(self.weights[0], self.sender.full(self.full_named_parameters(), version))
        else:
            send_stream(self.weights[self.rank], self.sender.delta(self.sharded_named_parameters(), version))
        st = self.sender.last_stats
        if st is None:
            return {}
        return {
            "payload_mb": st.payload_mb,
            "changed_elements": float(st.changed_elements),
            "elements": float(st.elements),
            "buckets": float(st.buckets),
            "seconds": st.seconds,
        }

    # -- checkpoints -------------------------------------------------------------------------
    def save_shards(self, path: str | Path) -> None:
        """Write this rank's shards of the models, optimisers and schedulers into ``path`` (collective)."""
        from rlkube.runtime.distributed.checkpoint import save_model_shards

        save_model_shards(path, self._stateful())

    def load_shards(self, path: str | Path) -> None:
        """Read the models and optimisers back from ``path``, resharded to this world (collective)."""
        from rlkube.runtime.distributed.checkpoint import load_model_shards

        load_model_shards(path, self._stateful())
        self.sender.reset()  # engines start from the checkpoint's weights: the first sync is dense

    def _stateful(self) -> dict[str, tuple[Any, Any, Any]]:
        """What a checkpoint holds of this rank: models, optimisers, LR schedulers (the reference
        policy is frozen at spec.model.path and needs nothing)."""
        out: dict[str, tuple[Any, Any, Any]] = {
            "actor": (self.actor.model, self.actor.optimizer, self.actor.scheduler)
        }
        if self.critic is not None:
            out["critic"] = (self.critic.model, self.critic.optimizer, self.critic.scheduler)
        return out
