"""The trainer runs the estimator, policy loss and aggregation the spec names, and rollout correction
weighs the update by the engine's log-probs carried on every sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlkube.runtime import algos
from rlkube.runtime.trainer.batch import Sample, collate

from .conftest import write_job


def _trainer(tmp_path: Path, task: Any, name: str = "job", **algo: Any) -> Any:
    from rlkube.api import load_rljob, resolve
    from rlkube.runtime.trainer.core import Trainer

    over: dict[str, Any] = {
        "training": {"trainBatchSize": 2, "miniBatchSize": 2, "microBatchSize": 4},  # on-policy shape
        "algorithm": {"name": "grpo", "groupSize": 4, **algo},
    }
    job = resolve(load_rljob(write_job(tmp_path / f"{name}.yaml", task, **over)))
    return Trainer(job, device="cpu")


def _samples(trainer: Any, shift_first: float = 0.0) -> list[Sample]:
    """8 samples whose engine log-probs are the trainer's own raw ones (minus ``shift_first`` on
    each response's first token: that token's rho = exp(shift_first))."""
    g = torch.Generator().manual_seed(1)
    vocab = int(trainer.actor.model.config.vocab_size)
    out = []
    for i in range(8):
        p = torch.randint(4, vocab, (3 + i % 2,), generator=g).tolist()
        r = torch.randint(4, vocab, (1 + i % 3,), generator=g).tolist()
        out.append(Sample(p, r, f"p{i // 4}", 0, score=float(i % 2)))
    raw, _ = trainer.actor.compute_logprobs(collate(out, trainer.pad_id), temperature=1.0)
    for i, s in enumerate(out):
        lp = raw[i, : len(s.response_ids)].tolist()
        lp[0] -= shift_first
        s.rollout_logprobs = lp
    return out


def test_collate_carries_the_engines_logprobs_only_when_every_sample_has_them() -> None:
    a = Sample([1, 2], [5, 6, 7], "g", 0, rollout_logprobs=[-0.1, -0.2, -0.3])
    b = Sample([1], [8], "g", 0, rollout_logprobs=[-0.5])
    batch = collate([a, b], 0)
    assert batch.extras["rollout_logp"].flatten().tolist() == pytest.approx(
        [-0.1, -0.2, -0.3, -0.5, 0.0, 0.0]
    )
    assert "rollout_logp" not in collate([a, Sample([1], [8], "g", 0)], 0).extras
    assert Sample.from_dict(a.to_dict()).rollout_logprobs == a.rollout_logprobs  # replay checkpoints


def test_tis_on_agreeing_logprobs_weighs_one_and_forces_the_old_logprob_pass(
    tmp_path: Path, tiny_task: Any, monkeypatch: Any
) -> None:
    tr = _trainer(tmp_path, tiny_task, rolloutCorrection={"mode": "tis", "threshold": 2.0})
    seen: list[torch.Tensor | None] = []
    real = algos.POLICY_LOSSES["vanilla"]

    def spy(*a: Any, **k: Any) -> Any:
        seen.append(k.get("is_weights"))
        return real(*a, **k)

    monkeypatch.setitem(algos.POLICY_LOSSES, "vanilla", spy)
    m = tr.train(_samples(tr), {})
    assert m["actor/old_logprob_pass"] == 1.0  # on-policy shape, but the weights need pi_old first
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_corr/is_clip_frac"] == 0.0
    assert m["rollout_corr/logprob_diff_mean"] == pytest.approx(0.0, abs=1e-5)
    assert seen and all(w is not None for w in seen)


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_a_token_the_engine_found_3x_less_likely_is_cut(tmp_path: Path, tiny_task: Any, mode: str) -> None:
    tr = _trainer(tmp_path, tiny_task, rolloutCorrection={"mode": mode, "threshold": 2.0})
    samples = _samples(tr, shift_first=float(torch.log(torch.tensor(3.0))))
    tokens = sum(len(s.response_ids) for s in samples)
    m = tr.train(samples, {})
    assert m["rollout_corr/is_clip_frac"] == pytest.approx(8 / tokens, abs=1e-6)  # each first token
    # tis keeps the token at weight 2; mis drops it and weighs the rest 1
    expected = (8 * 2.0 + tokens - 8) / tokens if mode == "tis" else 1.0
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(expected, abs=1e-4)
    assert m["rollout_corr/logprob_diff_mean"] == pytest.approx(8 * 1.0986123 / tokens, abs=1e-4)


def test_rollout_correction_without_engine_logprobs_names_the_setting(tmp_path: Path, tiny_task: Any) -> None:
    tr = _trainer(tmp_path, tiny_task, rolloutCorrection={})
    samples = _samples(tr)
    samples[3].rollout_logprobs = []
    with pytest.raises(ValueError, match="rolloutCorrection needs the engine's log-prob"):
        tr.train(samples, {})


def test_the_trainers_side_is_taken_at_temperature_one_like_the_engines(
    tmp_path: Path, tiny_task: Any, monkeypatch: Any
) -> None:
    tr = _trainer(tmp_path, tiny_task, temperature=0.7, rolloutCorrection={"mode": "tis"})
    samples = _samples(tr)  # raw (temperature-1) log-probs, as the engines report
    temps: list[Any] = []
    real = tr.actor.compute_logprobs
    monkeypatch.setattr(
        tr.actor,
        "compute_logprobs",
        lambda b, *a, **k: (temps.append(k.get("temperature")), real(b, *a, **k))[1],
    )
    m = tr.train(samples, {})
    assert temps == [None, 1.0]  # pi_old at the sampling temperature for PPO, then the raw view
    assert m["rollout_corr/logprob_diff_mean"] == pytest.approx(0.0, abs=1e-5)


def test_the_spec_picks_estimator_loss_and_aggregation(
    tmp_path: Path, tiny_task: Any, monkeypatch: Any
) -> None:
    calls: list[str] = []
    real = algos.ESTIMATORS["rloo"]
    monkeypatch.setitem(algos.ESTIMATORS, "rloo", lambda **k: (calls.append("rloo"), real(**k))[1])
    tr = _trainer(
        tmp_path, tiny_task, advantageEstimator="rloo", policyLoss="cispo", lossAggregation="token-sum"
    )
    assert (tr.loss_cfg.policy_loss, tr.loss_cfg.agg_mode, tr.critic) == ("cispo", "token-sum", None)
    m = tr.train(_samples(tr), {})
    assert calls == ["rloo"] and torch.isfinite(torch.tensor(m["actor/pg_loss"]))
    gspo = _trainer(tmp_path, tiny_task, "gspo", policyLoss="gspo")
    assert (gspo.loss_cfg.policy_loss, gspo.loss_cfg.agg_mode) == ("gspo", "seq-mean-token-mean")
    assert gspo.loss_cfg.norm_constant == 4.0  # Dr. GRPO's H is data.maxResponseLength, as verl's


def test_gae_brings_a_critic_whatever_the_name(tmp_path: Path, tiny_task: Any) -> None:
    tr = _trainer(tmp_path, tiny_task, advantageEstimator="gae")
    assert tr.critic is not None
    m = tr.train(_samples(tr), {})
    assert "critic/vf_loss" in m
