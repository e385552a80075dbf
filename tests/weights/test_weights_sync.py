"""Weight sync end to end in one process: bit-identical receivers, payload size, refusal on corruption."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlkube.runtime.weights import (
    LocalShard,
    WeightBucket,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    apply_buckets,
)
from rlkube.runtime.weights.bucket import PAD_BYTES

torch.set_num_threads(1)

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included), what 'the same weights' must mean."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def perturb(state: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> int:
    """Change exactly round(fraction * numel) random elements of each tensor to new values."""
    changed = 0
    for t in state.values():
        flat = t.view(-1)
        k = round(fraction * flat.numel())
        if k == 0:
            continue
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = flat[idx] + torch.rand(k, generator=gen).to(flat.dtype) + 1.0
        changed += k
    return changed


def make_state(gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    shapes = {"embed": (512, 64), "q": (64, 64), "norm": (64,), "mlp": (256, 64), "head": (512, 64)}
    return {k: torch.randn(s, generator=gen).to(dtype) for k, s in shapes.items()}


def test_delta_syncs_keep_receiver_bit_identical_and_first_is_dense() -> None:
    gen = torch.Generator().manual_seed(1)
    trainer = make_state(gen)
    engine = {k: torch.zeros_like(v) for k, v in trainer.items()}
    receiver = WeightReceiver(engine)
    sender = WeightSender(bucket_megabytes=0.02)  # many buckets, params split across them
    for version in range(6):
        if version:
            perturb(trainer, 0.02, gen)
        receiver.apply(list(sender.delta(trainer.items(), version)))
        stats = sender.last_stats
        assert stats is not None and stats.version == version
        assert all(bit_equal(trainer[k], engine[k]) for k in trainer)
        if version == 0:
            assert stats.changed_ratio == 1.0 and stats.dense_params == len(trainer)
        else:
            assert 0.015 < stats.changed_ratio < 0.025 and stats.dense_params == 0
    assert receiver.version == 5


def test_buckets_are_bounded_and_large_params_split() -> None:
    gen = torch.Generator().manual_seed(2)
    trainer = {"big": torch.randn(1000, 100, generator=gen).to(torch.bfloat16)}  # 200 kB
    sender = WeightSender(bucket_megabytes=0.05)
    buckets = list(sender.full(trainer.items(), 0))
    cap = int(0.05 * 2**20)
    assert len(buckets) >= 4
    assert all(b.nbytes <= cap for b in buckets)
    assert [b.index for b in buckets] == list(range(len(buckets))) and buckets[-1].final
    engine = {"big": torch.zeros_like(trainer["big"])}
    assert apply_buckets(engine, buckets) == {"big"}
    assert bit_equal(engine["big"], trainer["big"])


@pytest.mark.parametrize("fraction", [0.01, 0.03, 0.1])
def test_delta_payload_tracks_changed_fraction(fraction: float) -> None:
    gen = torch.Generator().manual_seed(3)
    trainer = make_state(gen)
    sender = WeightSender(bucket_megabytes=1)
    list(sender.full(trainer.items(), 0))
    full = sender.last_stats
    assert full is not None
    changed = perturb(trainer, fraction, gen)
    buckets = list(sender.delta(trainer.items(), 1))
    delta = sender.last_stats
    assert delta is not None and delta.changed_elements == changed
    index_overhead_mb = changed * 4 / 1e6  # int32 positions
    padding_mb = len(buckets) * (PAD_BYTES + 64 * 2 * len(trainer)) / 1e6
    assert delta.payload_mb <= 1.5 * fraction * full.payload_mb + index_overhead_mb + padding_mb
    assert delta.payload_mb >= changed * 6 / 1e6  # it really carries every change


def test_full_sync_from_fp32_master_weights_ships_bf16() -> None:
    gen = torch.Generator().manual_seed(4)
    master = make_state(gen, torch.float32)
    engine = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in master.items()}
    sender = WeightSender(dtype=torch.bfloat16)
    for version in range(3):
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=gen) * 1e-3)  # small steps: many bf16 values unchanged
        apply_buckets(engine, list(sender.delta(master.items(), version)))
        assert all(bit_equal(engine[k], master[k].to(torch.bfloat16)) for k in master)


def _corrupt(bucket: WeightBucket, byte: int) -> WeightBucket:
    payload = bucket.payload.clone()
    payload[byte % payload.numel()] ^= 0x10
    return dataclasses.replace(bucket, payload=payload)


@pytest.mark.parametrize("first_sync", [True, False])
def test_flipped_byte_is_detected_and_nothing_is_applied(first_sync: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    trainer = make_state(gen)
    engine = {k: torch.zeros_like(v) for k, v in trainer.items()}
    receiver = WeightReceiver(engine)
    sender = WeightSender(bucket_megabytes=0.01)
    if not first_sync:
        receiver.apply(list(sender.delta(trainer.items(), 0)))
        perturb(trainer, 0.05, gen)
    before = {k: v.clone() for k, v in engine.items()}
    buckets = list(sender.delta(trainer.items(), 1))
    assert len(buckets) >= 2
    bad = [*buckets[:-1], _corrupt(buckets[-1], 77)]  # corruption in the LAST bucket: earlier ones are fine
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        receiver.apply(bad)
    assert all(bit_equal(before[k], engine[k]) for k in engine)
    assert receiver.version == (None if first_sync else 0)


def test_missing_bucket_shape_mismatch_and_stale_base_are_refused() -> None:
    gen = torch.Generator().manual_seed(6)
    trainer = make_state(gen)
    engine = {k: torch.zeros_like(v) for k, v in trainer.items()}
    receiver = WeightReceiver(engine)
    sender = WeightSender(bucket_megabytes=0.05)
    buckets = list(sender.full(trainer.items(), 0))
    with pytest.raises(WeightSyncError, match="incomplete sync"):
        receiver.apply(buckets[:1] + buckets[2:])
    wrong = {**engine, "q": torch.zeros(32, 64, dtype=torch.bfloat16)}
    with pytest.raises(WeightSyncError, match="receiver holds"):
        apply_buckets(wrong, buckets)
    receiver.apply(buckets)
    # A delta the receiver refused (corrupt) advanced the sender's snapshot: the next delta's base
    # is a version the receiver never got, so it is refused rather than stacked on the wrong weights.
    perturb(trainer, 0.05, gen)
    refused = list(sender.delta(trainer.items(), 1))
    with pytest.raises(WeightSyncError):
        receiver.apply([_corrupt(refused[0], 3), *refused[1:]])
    perturb(trainer, 0.05, gen)
    with pytest.raises(WeightSyncError, match="must reset"):
        receiver.apply(list(sender.delta(trainer.items(), 2)))
    sender.reset()
    receiver.apply(list(sender.delta(trainer.items(), 2)))
    assert all(bit_equal(trainer[k], engine[k]) for k in trainer)


def test_unchanged_weights_ship_an_empty_final_bucket() -> None:
    gen = torch.Generator().manual_seed(7)
    trainer = make_state(gen)
    engine = {k: v.clone() for k, v in trainer.items()}
    receiver = WeightReceiver(engine, version=None)
    sender = WeightSender()
    receiver.apply(list(sender.delta(trainer.items(), 0)))
    buckets = list(sender.delta(trainer.items(), 1))
    assert len(buckets) == 1 and buckets[0].final and not buckets[0].entries
    assert receiver.apply(buckets) == set() and receiver.version == 1


def test_local_shards_reassemble_into_the_full_parameter() -> None:
    gen = torch.Generator().manual_seed(8)
    full = torch.randn(10, 6, generator=gen).to(torch.bfloat16)
    engine = {"w": torch.zeros_like(full)}
    senders = [WeightSender(bucket_megabytes=0.01), WeightSender(bucket_megabytes=0.01)]
    for version in range(3):
        if version:
            perturb({"w": full}, 0.2, gen)
        shards = [LocalShard(full[:5], (10, 6), 0), LocalShard(full[5:], (10, 6), 30)]
        buckets = []
        for s, shard in zip(senders, shards, strict=True):
            buckets += list(s.delta([("w", shard)], version))
        last = len(buckets) - 1
        buckets = [dataclasses.replace(b, index=i, final=i == last) for i, b in enumerate(buckets)]
        apply_buckets(engine, buckets)
        assert bit_equal(engine["w"], full)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=5),
    steps=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5),
    bucket_kb=st.sampled_from([4, 9, 64]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_any_update_sequence_leaves_receiver_bit_identical(
    shapes: list[tuple[int, int]], steps: list[float], bucket_kb: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    trainer = {f"p{i}": torch.randn(s, generator=gen).to(dtype) for i, s in enumerate(shapes)}
    engine = {k: torch.zeros_like(v) for k, v in trainer.items()}
    receiver = WeightReceiver(engine)
    sender = WeightSender(bucket_megabytes=bucket_kb / 1024)
    for version, fraction in enumerate(steps):
        perturb(trainer, fraction, gen)
        if version % 3 == 2:  # mix in full syncs
            receiver.apply(list(sender.full(trainer.items(), version)))
        else:
            receiver.apply(list(sender.delta(trainer.items(), version)))
        assert all(bit_equal(trainer[k], engine[k]) for k in trainer)
