"""What the actor, the reference policy and the critic share: optimiser and loss settings, the LR
schedule, micro-batching and the device / autocast / FSDP2 base class."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlkube.runtime.trainer.batch import Batch
from rlkube.runtime.trainer.fsdp import shard_fsdp2, world
from rlkube.runtime.trainer.modeling import resolve_device
from rlkube.runtime.trainer.packing import (
    cut_rows,
    group_widths,
    row_lengths,
    split_to_count,
    token_micro_batches,
)


@dataclass(frozen=True)
class OptimConfig:
    """Optimiser and schedule of one trainable worker."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 0
    total_steps: int = 100
    schedule: str = "constant"  # constant | cosine | linear (after warmup)
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class LossConfig:
    """The policy loss knobs, straight from ``spec.algorithm``."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = 3.0
    policy_loss: str = "vanilla"  # a name in rlkube.runtime.algos.POLICY_LOSSES
    agg_mode: str = "token-mean"
    norm_constant: float | None = None  # seq-mean-token-sum-norm's H (the max response length)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    value_clip: float = 0.2

    def __post_init__(self) -> None:
        from rlkube.runtime.algos import POLICY_LOSSES

        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"unknown policy loss {self.policy_loss!r}; expected one of {', '.join(POLICY_LOSSES)}"
            )


def lr_lambda(cfg: OptimConfig) -> Any:
    """Multiplier of the base LR at a step: linear warmup, then constant / cosine / linear decay to 0."""

    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(cfg.total_steps - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        if cfg.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if cfg.schedule == "linear":
            return 1.0 - progress
        raise ValueError(f"unknown lr schedule {cfg.schedule!r}")

    return f


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass over rows ``rows`` of its batch, in that order.

    ``index`` holds the rows on the device (None: the rows are consecutive) and ``batch`` those
    rows, trimmed to their own widths when micro-batches are chosen by tokens. ``stand_in``: a pass
    that only keeps this rank in step with the others (FSDP2 collectives); its loss is multiplied
    by zero and its outputs are dropped.
    """

    rows: list[int]
    batch: Batch
    index: Tensor | None = None
    stand_in: bool = False


def scatter_pass(out: Tensor, plan: MicroBatch, part: Tensor) -> None:
    """Write one pass's per-token result ``part`` [b, t] into the rows it came from in ``out`` [B, T]."""
    if plan.index is None:  # consecutive rows
        out[plan.rows[0] : plan.rows[-1] + 1, : part.shape[1]] = part.to(out.dtype)
    else:
        out[plan.index.to(out.device), : part.shape[1]] = part.to(out.dtype)


def accumulate(acc: dict[str, Tensor], key: str, value: Tensor) -> None:
    acc[key] = acc[key] + value if key in acc else value


class TrainWorker:
    """What actor, reference and critic share: device, autocast, FSDP2 wrapping."""

    def __init__(
        self,
        *,
        device: str | torch.device | None,
        bf16: bool | None,
        micro_batch_size: int,
        replicate: int = 1,
        micro_batch_tokens: int = 0,
    ) -> None:
        self.device = resolve_device(device)
        self.bf16 = self.device.type != "cpu" if bf16 is None else bf16
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens  # > 0: passes chosen by padded tokens
        self.rank, self.world_size = world()
        self.replicate = replicate  # HSDP replica groups (pods); 1: plain FSDP2 over every rank

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 autocast for one rank (FSDP2 casts for several). Autocast keeps each fp32 weight's
        bf16 cast until its outermost context exits, so a context held over several forward passes
        casts every weight once, not once per pass."""
        if self.bf16 and self.world_size == 1:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def autocast_off(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast paused inside :meth:`autocast` (loss maths and backward in their own dtypes)
        without ending the outer context, whose weight casts stay cached."""
        if self.bf16 and self.world_size == 1:
            return torch.autocast(device_type=self.device.type, enabled=False)
        return contextlib.nullcontext()

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.world_size > 1:
            return shard_fsdp2(model, self.device, self.bf16, self.replicate)
        return model

    def plan_micro_batches(self, batch: Batch) -> list[MicroBatch]:
        """The passes over a host ``batch``, on this worker's device: ``micro_batch_size``
        consecutive rows each, or, with ``micro_batch_tokens``, rows grouped by length and trimmed
        (``trainer.packing``), as many passes on every rank. The batch moves to the device once and
        is cut there, so no pass waits for the device before its kernels are queued."""
        on_device = batch.to(self.device)
        if self.micro_batch_tokens <= 0:
            size, n = self.micro_batch_size, batch.size
            return [
                MicroBatch(list(range(s, min(s + size, n))), on_device.rows(s, min(s + size, n)))
                for s in range(0, n, size)
            ]
        plens, rlens = row_lengths(batch)
        groups = token_micro_batches(plens, rlens, self.micro_batch_tokens)
        count = len(groups)
        if self.world_size > 1:
            import torch.distributed as dist

            n = torch.tensor([count], dtype=torch.int64, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            count = int(n.item())
        groups, stand_ins = split_to_count(groups, count)
        shortest = min(range(batch.size), key=lambda i: plens[i] + rlens[i])
        groups += [[shortest]] * stand_ins
        # Every pass's row indices reach the device in one copy.
        flat = torch.tensor([r for g in groups for r in g], dtype=torch.long).to(self.device)
        plans = []
        for k, (g, index) in enumerate(zip(groups, flat.split([len(g) for g in groups]), strict=True)):
            sub = cut_rows(on_device, index, *group_widths(plens, rlens, g))
            plans.append(MicroBatch(g, sub, index, stand_in=k >= len(groups) - stand_ins))
        return plans

    def global_counts(self, mini: Batch) -> tuple[float, float]:
        """Loss denominators of a mini-batch spread over every rank, scaled for FSDP's gradient mean.

        Each rank holds whole prompt groups of the mini-batch. FSDP2 averages
        gradients over ranks, so dividing each rank's summed loss by ``global / world_size`` makes
        the averaged gradient that of the global token-mean (or seq-mean): N ranks compute the
        same update as one.
        """
        tokens = float(mini.response_mask.sum().item())
        real = mini.extras.get("real_rows")  # padding rows of an uneven split are no sequence
        seqs = mini.size if real is None else int(real.sum().item())
        if self.world_size > 1:
            import torch.distributed as dist

            t = torch.tensor([tokens, float(seqs)], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            tokens, seqs = float(t[0]) / self.world_size, float(t[1]) / self.world_size
        return tokens, seqs

    def reduce_metrics(
        self,
        means: dict[str, Tensor],
        weighted: dict[str, Tensor],
        local_tokens: float,
        maxima: dict[str, Tensor] | None = None,
    ) -> dict[str, float]:
        """Per-rank metrics -> global ones, as floats (one host sync).

        ``means`` are averaged over ranks (loss terms, already scaled for the global batch),
        ``weighted`` averaged by each rank's token count, ``maxima`` maxed over ranks.
        """
        maxima = maxima or {}
        vals = [means[k].reshape(()).double() for k in means]
        vals += [weighted[k].reshape(()).double() * local_tokens for k in weighted]
        vec = torch.stack([*vals, torch.tensor(local_tokens, dtype=torch.float64, device=self.device)])
        mx = torch.stack([maxima[k].reshape(()).double() for k in maxima]) if maxima else None
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(vec)
            if mx is not None:
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        host = vec.tolist()
        total = max(host[-1], 1e-12)
        out = {k: host[i] / self.world_size for i, k in enumerate(means)}
        out.update({k: host[len(means) + i] / total for i, k in enumerate(weighted)})
        if mx is not None:
            out.update(zip(maxima, mx.tolist(), strict=True))
        return out
