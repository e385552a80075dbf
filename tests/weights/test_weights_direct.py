"""Direct full sync (trainer and engine in one process): validated first, exact, tied weights once."""

from __future__ import annotations

import pytest
import torch

from rlkube.runtime.weights import DirectCopier, WeightSyncError, copy_direct, plan_direct_copy


def _pair(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(32, 8, generator=g),
        "layer.weight": torch.randn(8, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g),
    }


def test_fp32_master_weights_land_bit_identical_as_their_bf16_cast() -> None:
    src = _pair(0)
    dst = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in src.items()}
    stats = copy_direct(dst, src.items(), version=3, require_all=True)
    for k, v in src.items():
        assert torch.equal(dst[k].view(torch.int16), v.to(torch.bfloat16).view(torch.int16)), k
    assert stats.version == 3 and stats.tensors == 3 and stats.groups == 1
    assert stats.payload_mb == pytest.approx(sum(v.numel() * 2 for v in src.values()) / 1e6)


def test_a_bad_tensor_anywhere_raises_before_anything_is_written() -> None:
    src = _pair(0)
    dst = _pair(1)
    before = {k: v.clone() for k, v in dst.items()}
    bad = [*[*src.items()][:-1], ("layer.bias", torch.randn(9))]  # the last one has the wrong shape
    with pytest.raises(WeightSyncError, match=r"layer\.bias: receiver holds \(8,\), sender has \(9,\)"):
        copy_direct(dst, bad, version=1)
    with pytest.raises(WeightSyncError, match="no parameter 'missing'"):
        copy_direct(dst, [*src.items(), ("missing", torch.zeros(1))], version=1)
    with pytest.raises(WeightSyncError, match=r"cannot copy torch\.int64"):
        copy_direct(dst, [("layer.bias", torch.zeros(8, dtype=torch.long))], version=1)
    for k, v in before.items():
        assert torch.equal(dst[k], v), f"{k} was written by a sync that failed"


def test_require_all_names_what_a_full_sync_missed() -> None:
    dst = _pair(1)
    with pytest.raises(WeightSyncError, match=r"misses 1 parameters, e.g. \['layer.bias'\]"):
        copy_direct(dst, [(k, v) for k, v in _pair(0).items() if k != "layer.bias"], 1, require_all=True)


def test_tied_embeddings_are_written_once() -> None:
    shared = torch.zeros(32, 8)
    dst = {"embed.weight": shared, "lm_head.weight": shared, "layer.weight": torch.zeros(8, 8)}
    src = _pair(0)
    items = [("embed.weight", src["embed.weight"]), ("lm_head.weight", src["embed.weight"])]
    items.append(("layer.weight", src["layer.weight"]))
    plan = plan_direct_copy(dst, items, require_all=True)
    assert sum(len(d) for d, _ in plan) == 2  # one copy into the shared storage, one into layer
    copy_direct(dst, items, 1)
    assert torch.equal(shared, src["embed.weight"])


def test_a_held_copier_reuses_its_plan_only_while_both_sides_stay_put() -> None:
    src = _pair(0)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    copier = DirectCopier()
    for version in range(3):  # the trainer's steady state: same tensors, new values
        for v in src.values():
            v.add_(1.0)
        copier(dst, src.items(), version, require_all=True)
        assert all(torch.equal(dst[k], v) for k, v in src.items())
    assert copier.replans == 1

    # A sender whose tensors are new each sync (gathered shards) but alike in name, shape and dtype
    # keeps the plan and is still copied from; a bad one raises with the engine untouched even
    # though a plan for good tensors of the same names is cached.
    fresh = {k: v + 1 for k, v in src.items()}
    copier(dst, fresh.items(), 3)
    assert copier.replans == 1 and all(torch.equal(dst[k], v) for k, v in fresh.items())
    before = {k: v.clone() for k, v in dst.items()}
    for bad in ({**fresh, "layer.bias": torch.randn(9)}, {**fresh, "layer.bias": torch.zeros(8).long()}):
        with pytest.raises(WeightSyncError, match=r"layer\.bias"):
            copier(dst, bad.items(), 4)
        assert all(torch.equal(dst[k], v) for k, v in before.items())

    # The receiver re-allocated (an engine rebuilt its weights): re-validated against the new ones.
    dst2 = {k: torch.zeros_like(v) for k, v in src.items()}
    copier(dst2, fresh.items(), 5)
    assert copier.replans == 2 and torch.equal(dst2["embed.weight"], fresh["embed.weight"])

    # Tied weights that come apart in the receiver are seen (addresses are part of the key).
    shared = torch.zeros(32, 8)
    tied = {"embed.weight": shared, "lm_head.weight": shared}
    items = [("embed.weight", src["embed.weight"]), ("lm_head.weight", src["embed.weight"] * 2)]
    tcopy = DirectCopier()
    assert tcopy(tied, items, 1).tensors == 1
    untied = {"embed.weight": shared, "lm_head.weight": torch.zeros(32, 8)}
    assert tcopy(untied, items, 2).tensors == 2
    assert torch.equal(untied["lm_head.weight"], src["embed.weight"] * 2)

    # A plan made without require_all is not trusted for a sync that must cover everything.
    part = DirectCopier()
    part(dst, [("layer.bias", src["layer.bias"])], 6)
    with pytest.raises(WeightSyncError, match="misses 2 parameters"):
        part(dst, [("layer.bias", src["layer.bias"])], 7, require_all=True)
