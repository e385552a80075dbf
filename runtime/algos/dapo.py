"""DAPO's data-side tricks (Yu et al. 2025): the overlong-buffer length penalty (sec. 3.4, eq. 13) and
dynamic sampling (sec. 3.2), which drops prompt groups whose responses all scored the same (their GRPO
advantages are all 0, so they only dilute the batch) and keeps generating until the batch is full."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """Soft overlong punishment: 0 up to ``max - buffer`` tokens, then falling linearly to ``-factor`` at
    ``max``: ``min(-(len - (max - buffer)) / buffer * factor, 0)`` (DAPO eq. 13, scaled by ``factor``).

    Lengths past ``max`` keep falling (the paper gives -1 there; a truncated response is exactly ``max``
    long, so this only matters if lengths are measured before truncation). Added to the task reward.
    """
    if buffer_length <= 0 or buffer_length > max_response_length:
        raise ValueError(f"buffer_length must be in (0, max_response_length], got {buffer_length}")
    lengths = response_lengths.to(torch.float32)
    expected = max_response_length - buffer_length
    return torch.clamp(-(lengths - expected) / buffer_length * penalty_factor, max=0.0)


def dynamic_sampling_keep(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Bool ``[B]``: True for samples whose group has at least two different rewards.

    Groups where every reward is equal (all right, all wrong, or a single sample) are dropped.
    """
    if rewards.ndim != 1 or rewards.shape != group_index.shape:
        raise ValueError("rewards and group_index must both be [B]")
    _, inverse = torch.unique(group_index, return_inverse=True)
    n = int(inverse.max().item()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)
    gmax = torch.full((n,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, inverse, r, "amax"
    )
    gmin = torch.full((n,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(
        0, inverse, r, "amin"
    )
    return (gmax > gmin)[inverse]


class DynamicSamplingExhaustedError(RuntimeError):
    """Dynamic sampling generated ``max_num_gen_batches`` batches without filling the training batch."""


class DynamicSamplingBuffer(Generic[T]):
    """Accumulates the kept groups of successive generation batches until ``target_groups`` are held.

    Usage per training step: ``while not buf.add(items, rewards, group_index): generate more``; then
    ``groups = buf.take()``. ``items`` are whatever per-sample payloads the trainer keeps (one per row of
    ``rewards``). ``max_num_gen_batches <= 0`` means no limit; otherwise generating that many batches
    without filling up raises :class:`DynamicSamplingExhaustedError` (the task is too easy or too hard
    for the policy). Surplus groups of the last batch are discarded, as DAPO does.
    """

    def __init__(self, target_groups: int, max_num_gen_batches: int = 0) -> None:
        if target_groups <= 0:
            raise ValueError(f"target_groups must be > 0, got {target_groups}")
        self.target_groups = target_groups
        self.max_num_gen_batches = max_num_gen_batches
        self._groups: list[list[T]] = []
        self.num_gen_batches = 0
        self.num_dropped_groups = 0

    @property
    def num_groups(self) -> int:
        """Kept groups held so far."""
        return len(self._groups)

    @property
    def is_full(self) -> bool:
        return len(self._groups) >= self.target_groups

    def add(self, items: Sequence[T], rewards: Tensor, group_index: Tensor) -> bool:
        """Add one generation batch; return True once ``target_groups`` groups are held."""
        if len(items) != rewards.shape[0] or rewards.shape != group_index.shape:
            raise ValueError(
                f"items ({len(items)}), rewards {tuple(rewards.shape)} and group_index "
                f"{tuple(group_index.shape)} must all have one entry per sample"
            )
        self.num_gen_batches += 1
        keep = dynamic_sampling_keep(rewards, group_index).tolist()
        order: list[int] = []
        members: dict[int, list[T]] = {}
        kept: dict[int, bool] = {}
        for item, gid, k in zip(items, group_index.tolist(), keep, strict=True):
            if gid not in members:
                order.append(gid)
                members[gid] = []
                kept[gid] = k
            members[gid].append(item)
        for gid in order:
            if kept[gid]:
                self._groups.append(members[gid])
            else:
                self.num_dropped_groups += 1
        if self.is_full:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise DynamicSamplingExhaustedError(
                f"dynamic sampling kept {len(self._groups)} of {self.target_groups} groups after "
                f"{self.num_gen_batches} generation batches "
                f"(max_num_gen_batches={self.max_num_gen_batches}); "
                "rewards are too uniform: raise max_num_gen_batches or make the task harder/easier"
            )
        return False

    def take(self) -> list[list[T]]:
        """The first ``target_groups`` kept groups (each a list of its samples); resets the buffer."""
        if not self.is_full:
            raise RuntimeError(
                f"buffer holds {len(self._groups)} of {self.target_groups} groups; add more first"
            )
        out = self._groups[: self.target_groups]
        self._groups = []
        self.num_gen_batches = 0
        self.num_dropped_groups = 0
        return out
