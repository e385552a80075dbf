"""masked_* reductions and every loss aggregation mode, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkube.runtime.algos import AGG_MODES, aggregate_loss, masked_mean, masked_sum, masked_var, masked_whiten

torch.set_num_threads(1)

# Row 0 has 3 real tokens, row 1 has 1; the padded entries hold junk that must never count.
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_sum_and_mean_ignore_padding() -> None:
    assert masked_sum(LOSS, MASK).item() == pytest.approx(10.0)
    assert masked_mean(LOSS, MASK).item() == pytest.approx(2.5)
    assert masked_mean(LOSS, MASK, dim=-1).tolist() == pytest.approx([2.0, 4.0])


def test_masked_mean_of_nothing_is_zero_not_nan() -> None:
    assert masked_mean(torch.tensor([[5.0, 6.0]]), torch.zeros(1, 2)).item() == 0.0


def test_masked_var_is_unbiased() -> None:
    x = torch.tensor([[2.0, 4.0, 6.0, 1000.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    assert masked_var(x, m).item() == pytest.approx(4.0)  # ((-2)^2 + 0 + 2^2) / (3 - 1)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(8.0 / 3.0)


def test_masked_whiten() -> None:
    x = torch.tensor([[2.0, 4.0, 6.0, 1000.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    # mean 4, unbiased std 2
    assert masked_whiten(x, m).tolist()[0] == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    assert masked_whiten(x, m, shift_mean=False).tolist()[0] == pytest.approx([3.0, 4.0, 5.0, 0.0], abs=1e-6)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10.0 / 4.0),  # (1+2+3+4) / 4 tokens
        ("token-sum", 10.0),  # no normalisation at all
        ("seq-mean-token-sum", (6.0 + 4.0) / 2.0),
        ("seq-mean-token-mean", (2.0 + 4.0) / 2.0),
        ("seq-mean-token-sum-norm", 10.0 / (3.0 * 2.0)),  # / (T = 3) / (B = 2), as verl 0.9
    ],
)
def test_every_aggregation_mode(mode: str, expected: float) -> None:
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_sum_norm_uses_the_given_constant() -> None:
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_constant=5).item() == pytest.approx(1.0)


def test_sum_norm_is_dr_grpo_equation() -> None:
    # Dr. GRPO (Liu et al. 2025, eq. 2): (1/G) sum_i sum_t l_it, here also / H = the max response length,
    # so it is seq-mean-token-sum / H, and a longer response weighs more (no 1/|o_i|).
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 2 + [0] * 4, [1] * 5 + [0], [0] * 6])  # one empty row counts in G
    horizon = 16.0
    by_hand = sum(float(loss[i, t]) for i in range(4) for t in range(6) if mask[i, t]) / (4 * horizon)
    got = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_constant=horizon)
    assert got.item() == pytest.approx(by_hand, rel=1e-12)
    seq_sum = aggregate_loss(loss, mask, "seq-mean-token-sum")
    assert got.item() == pytest.approx(seq_sum.item() / horizon, rel=1e-12)


def test_token_sum_does_not_depend_on_the_counts() -> None:
    kw = {"global_tokens": 99, "global_seqs": 7, "norm_constant": 3.0}
    assert aggregate_loss(LOSS, MASK, "token-sum", **kw).item() == pytest.approx(10.0)  # type: ignore[arg-type]


def test_seq_mean_token_mean_counts_an_empty_sequence_as_zero() -> None:
    loss = torch.tensor([[1.0, 1.0], [9.0, 9.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(0.5)


def test_token_mean_weighs_tokens_not_sequences() -> None:
    # DAPO's point: a long sequence counts per token, unlike seq-mean-token-mean.
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(0.8)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(0.5)


def test_unknown_mode_is_rejected_with_the_choices() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS, MASK, "mean")


def _split_sum(loss: torch.Tensor, mask: torch.Tensor, mode: str, cut: int) -> torch.Tensor:
    total_tokens = int(mask.sum())
    total_seqs = loss.shape[0]
    parts = [(loss[:cut], mask[:cut]), (loss[cut:], mask[cut:])]
    return sum(
        (
            aggregate_loss(
                lm,
                mm,
                mode,
                global_tokens=total_tokens,
                global_seqs=total_seqs,
                norm_constant=loss.shape[1],
            )
            for lm, mm in parts
        ),
        start=torch.zeros(()),
    )


def test_micro_batches_with_global_counts_sum_to_the_full_batch_token_mean() -> None:
    full = aggregate_loss(LOSS, MASK, "token-mean")
    # A plain per-micro-batch mean would give (6/3 + 4/1) / 2 = 3.0, not 2.5.
    assert _split_sum(LOSS, MASK, "token-mean", cut=1).item() == pytest.approx(full.item())
    assert full.item() == pytest.approx(2.5)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(2, 6),
    cols=st.integers(1, 5),
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(tuple(AGG_MODES)),
    data=st.data(),
)
def test_micro_batch_split_equals_full_batch_for_every_mode(
    rows: int, cols: int, seed: int, mode: str, data: st.DataObject
) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, cols, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(rows, cols, generator=g) > 0.3).to(torch.float64)
    mask[0, 0] = 1.0
    cut = data.draw(st.integers(1, rows - 1))
    full = aggregate_loss(loss, mask, mode)
    (g_full,) = torch.autograd.grad(full, loss)
    split = _split_sum(loss, mask, mode, cut)
    (g_split,) = torch.autograd.grad(split, loss)
    assert math.isclose(full.item(), split.item(), rel_tol=1e-9, abs_tol=1e-12)
    assert torch.allclose(g_full, g_split)
