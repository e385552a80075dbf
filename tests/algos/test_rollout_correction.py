"""Truncated (tis) and masked (mis) importance weights between the engine's and the trainer's
log-probs, against hand-computed cases and the importance-sampling identity they approximate."""

from __future__ import annotations

import math

import pytest
import torch

from rlkube.runtime.algos import rollout_correction

torch.set_num_threads(1)

# rho = pi_old / pi_rollout per token: 1, 3, 1/4 on the real tokens; the 4th column is padding (junk).
OLD = torch.log(torch.tensor([[1.0, 3.0, 0.25, 50.0]]))
ROLLOUT = torch.zeros(1, 4)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_tis_truncates_above_the_threshold_and_keeps_every_token() -> None:
    c = rollout_correction(OLD, ROLLOUT, MASK, "tis", threshold=2.0)
    assert c.weights.tolist()[0] == pytest.approx([1.0, 2.0, 0.25, 0.0])
    assert c.mask.tolist() == MASK.tolist()
    m = c.as_dict()
    assert m["rollout_corr/is_weight_mean"] == pytest.approx((1.0 + 2.0 + 0.25) / 3)
    assert m["rollout_corr/is_clip_frac"] == pytest.approx(1 / 3)
    assert m["rollout_corr/logprob_diff_mean"] == pytest.approx((0.0 + math.log(3.0) + math.log(0.25)) / 3)


def test_mis_masks_tokens_outside_the_band_and_keeps_the_ratio_inside() -> None:
    c = rollout_correction(OLD, ROLLOUT, MASK, "mis", threshold=2.0)
    # 3 > 2 and 1/4 < 1/2 leave the loss; the ratio-1 token keeps weight 1.
    assert c.weights.tolist()[0] == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert c.mask.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    m = c.as_dict()
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0)
    assert m["rollout_corr/is_clip_frac"] == pytest.approx(2 / 3)
    wide = rollout_correction(OLD, ROLLOUT, MASK, "mis", threshold=4.0)
    assert wide.weights.tolist()[0] == pytest.approx([1.0, 3.0, 0.25, 0.0])  # all inside [1/4, 4]
    assert wide.as_dict()["rollout_corr/is_clip_frac"] == 0.0


def test_off_reports_the_gap_but_weighs_nothing() -> None:
    c = rollout_correction(OLD, ROLLOUT, MASK, "off")
    assert c.weights.tolist() == MASK.tolist() and c.mask.tolist() == MASK.tolist()
    assert c.as_dict()["rollout_corr/is_clip_frac"] == 0.0
    assert c.as_dict()["rollout_corr/logprob_diff_mean"] == pytest.approx(math.log(0.75) / 3)


def test_agreeing_sides_give_weight_one() -> None:
    lp = -torch.rand(3, 5)
    for mode in ("tis", "mis"):
        c = rollout_correction(lp, lp.clone(), torch.ones(3, 5), mode)
        assert c.weights.tolist() == torch.ones(3, 5).tolist()
        assert c.as_dict() == {
            "rollout_corr/is_weight_mean": 1.0,
            "rollout_corr/is_clip_frac": 0.0,
            "rollout_corr/logprob_diff_mean": 0.0,
        }


def test_weights_are_the_importance_sampling_identity_when_nothing_is_cut() -> None:
    # E_{y ~ pi_rollout}[rho(y) f(y)] = E_{y ~ pi_old}[f(y)], exactly, over a 4-token vocabulary: one row
    # per token, weighted by its rollout probability. TIS with C above every ratio is unbiased; a lower C
    # truncates and under-weights the tokens pi_old favours.
    p_roll = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    p_old = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    f = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    lo, lr = torch.log(p_old)[:, None], torch.log(p_roll)[:, None]
    w = rollout_correction(lo, lr, torch.ones(4, 1), "tis", threshold=3.0).weights[:, 0].double()
    assert float((p_roll * w * f).sum()) == pytest.approx(float((p_old * f).sum()), rel=1e-6)
    w2 = rollout_correction(lo, lr, torch.ones(4, 1), "tis", threshold=2.0).weights[:, 0].double()
    assert w2.tolist() == pytest.approx([0.625, 0.25 / 0.3, 1.25, 2.0])  # 2.5 truncated to 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "seq"}, "unknown rollout correction mode"),
        ({"mode": "tis", "threshold": 1.0}, "must be > 1"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rollout_correction(OLD, ROLLOUT, MASK, **kwargs)
    with pytest.raises(ValueError, match="share a shape"):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK, "tis")
