"""Faster on-policy updates without changing the maths: no old log-prob pass for one epoch over one
mini-batch, logits only at the response positions, a graph-free entropy metric."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from rlkube.runtime.algos import kl_penalty, masked_mean
from rlkube.runtime.trainer.batch import Batch, Sample, collate
from rlkube.runtime.trainer.modeling import accepts_logits_to_keep
from rlkube.runtime.trainer.policy import PolicyWorker, needs_old_logprob_pass, response_logits
from rlkube.runtime.trainer.worker import LossConfig, OptimConfig

from .conftest import write_job

VOCAB = 40


def _model(seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from rlkube.runtime.models.tiny import tiny_qwen2_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(VOCAB, hidden_size=64, num_heads=1))


def _worker(model: nn.Module, **loss: Any) -> PolicyWorker:
    return PolicyWorker(
        "",
        model=copy.deepcopy(model),
        device="cpu",
        bf16=False,
        micro_batch_size=3,
        optim=OptimConfig(lr=1e-3),
        loss=LossConfig(**loss),
    )


def _batch(n: int = 8, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        p = torch.randint(4, VOCAB, (2 + i % 3,), generator=g).tolist()
        r = torch.randint(4, VOCAB, (1 + i % 4,), generator=g).tolist()
        samples.append(Sample(p, r, f"g{i // 4}", 0, score=float(i % 2)))
    b = collate(samples, 0)
    b.extras["advantages"] = (torch.arange(n, dtype=torch.float32) - (n - 1) / 2)[:, None] * b.response_mask
    return b


def _flat(w: PolicyWorker) -> Tensor:
    return torch.cat([p.detach().flatten() for p in w.model.parameters()])


def test_needs_old_logprob_pass_only_off_policy() -> None:
    assert not needs_old_logprob_pass(1, 1)
    assert needs_old_logprob_pass(2, 1)
    assert needs_old_logprob_pass(1, 2)
    assert needs_old_logprob_pass(4, 3)


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_on_policy_update_without_old_logp_equals_update_with_it(entropy_coeff: float) -> None:
    model = _model()
    with_old, without = (
        _worker(model, entropy_coeff=entropy_coeff),
        _worker(model, entropy_coeff=entropy_coeff),
    )
    b1, b2 = _batch(), _batch()
    old, _ = with_old.compute_logprobs(b1)
    b1.extras["old_logp"] = old
    m1 = with_old.update(b1, num_mini_batches=1, epochs=1)
    m2 = without.update(b2, num_mini_batches=1, epochs=1)
    assert "old_logp" not in b2.extras
    init = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert not torch.allclose(_flat(with_old), init, atol=1e-5, rtol=0)  # the update did move them
    assert torch.allclose(_flat(with_old), _flat(without), atol=1e-6, rtol=0)
    # the update's detached log-probs are the pre-update old log-probs (what metrics compare to)
    assert without.last_update_logp is not None and with_old.last_update_logp is None
    assert torch.allclose(without.last_update_logp, old, atol=1e-6, rtol=0)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7)
    assert m2["actor/ratio_max"] == 1.0 and m2["actor/clip_frac"] == 0.0


def test_entropy_metric_matches_the_entropy_of_the_current_weights() -> None:
    w = _worker(_model())
    b = _batch()
    _, ent = w.compute_logprobs(b, with_entropy=True)
    assert ent is not None
    m = w.update(b, num_mini_batches=1)
    assert m["actor/entropy"] == pytest.approx(float(masked_mean(ent, b.response_mask)), rel=1e-5)


@pytest.mark.parametrize(("num_mini", "epochs"), [(2, 1), (1, 2), (4, 2)])
def test_off_policy_update_without_old_logp_raises(num_mini: int, epochs: int) -> None:
    w = _worker(_model())
    before = _flat(w)
    with pytest.raises(ValueError, match="old_logp"):
        w.update(_batch(), num_mini_batches=num_mini, epochs=epochs)
    assert torch.equal(before, _flat(w))  # refused before any step


class _NoLogitsToKeep(nn.Module):
    """The same LM behind a forward without ``logits_to_keep``: the full-sequence fallback."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Any:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logits_to_keep_gives_the_same_logits_as_slicing_the_full_sequence(temperature: float) -> None:
    from rlkube.runtime.trainer.token_logprob import token_logprobs

    model = _model().eval()
    wrapped = _NoLogitsToKeep(model)
    assert accepts_logits_to_keep(model) and not accepts_logits_to_keep(wrapped)
    b = _batch()
    calls: list[int] = []
    orig = model.forward

    def spy(*a: Any, **k: Any) -> Any:
        calls.append(int(k.get("logits_to_keep", 0)))
        return orig(*a, **k)

    with torch.no_grad():
        full = response_logits(wrapped, b)
        model.forward = spy  # type: ignore[method-assign]
        kept = response_logits(model, b)
    assert calls == [b.responses.shape[1] + 1]
    assert kept.shape == full.shape == (b.size, b.responses.shape[1], VOCAB)
    assert torch.allclose(kept, full, atol=1e-6, rtol=0)
    (lp_k, _), (lp_f, _) = (token_logprobs(x, b.responses, temperature) for x in (kept, full))
    assert torch.allclose(lp_k, lp_f, atol=1e-6, rtol=0)


def _trainer(tmp_path: Path, task: Any, mini: int, **algo: Any) -> Any:
    from rlkube.api import load_rljob, resolve
    from rlkube.runtime.trainer.core import Trainer

    over: dict[str, Any] = {"training": {"trainBatchSize": 2, "miniBatchSize": mini, "microBatchSize": 4}}
    if algo:
        over["algorithm"] = {"name": "grpo", "groupSize": 4, **algo}
    job = resolve(load_rljob(write_job(tmp_path / f"job{mini}.yaml", task, **over)))
    return Trainer(job, device="cpu")


def _samples(trainer: Any) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    vocab = int(trainer.actor.model.config.vocab_size)
    out = []
    for i in range(8):
        p = torch.randint(4, vocab, (3 + i % 2,), generator=g).tolist()
        r = torch.randint(4, vocab, (1 + i % 3,), generator=g).tolist()
        out.append(Sample(p, r, f"p{i // 4}", 0, score=float(i % 2)))
    return out


def test_trainer_skips_the_old_logprob_pass_only_for_one_epoch_one_mini_batch(
    tmp_path: Path, tiny_task: Any, monkeypatch: Any
) -> None:
    kl = {"kl": {"useKlLoss": True, "klLossType": "low_var_kl"}}
    on = _trainer(tmp_path, tiny_task, 2, **kl)  # 2 prompts per step, mini-batch of 2: on-policy
    samples = _samples(on)
    batch = collate(samples, on.pad_id)
    old, _ = on.actor.compute_logprobs(batch)
    assert on.ref is not None
    ref, _ = on.ref.compute_logprobs(batch)
    want_kl = float(masked_mean(kl_penalty(old, ref, "low_var_kl"), batch.response_mask))
    calls: list[int] = []
    real = on.actor.compute_logprobs
    monkeypatch.setattr(on.actor, "compute_logprobs", lambda b, **k: (calls.append(b.size), real(b, **k))[1])
    timing: dict[str, float] = {}
    m = on.train(samples, timing)
    assert calls == [] and m["actor/old_logprob_pass"] == 0.0 and "old_log_prob" in timing
    assert m["actor/kl_ref"] == pytest.approx(want_kl, rel=1e-4, abs=1e-7)
    assert m["actor/ratio_max"] == 1.0

    off = _trainer(tmp_path, tiny_task, 1)  # 2 mini-batches: needs pi_old from its own pass
    calls_off: list[int] = []
    real_off = off.actor.compute_logprobs
    monkeypatch.setattr(
        off.actor, "compute_logprobs", lambda b, **k: (calls_off.append(b.size), real_off(b, **k))[1]
    )
    m = off.train(samples, {})
    assert calls_off == [8] and m["actor/old_logprob_pass"] == 1.0 and m["actor/updates"] == 2.0
