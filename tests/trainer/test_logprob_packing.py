"""Chunked LM-head log-probs/entropy equal the full-logits path; token micro-batches lose nothing.

On the CPU with float64 inputs; both paths compute the softmax in float32 (the reference casts
its logits with ``.float()``), so they agree to float32 rounding: the chunked path recomputes the
logits in the backward pass and forms their gradient in closed form.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from rlkube.runtime.algos import entropy_from_logits, logprobs_from_logits
from rlkube.runtime.trainer.batch import Sample, collate
from rlkube.runtime.trainer.logprob import chunked_logprobs
from rlkube.runtime.trainer.packing import (
    padded_tokens,
    row_lengths,
    scatter_rows,
    token_micro_batches,
    trim_rows,
)


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 7), (0.7, 32), (1.3, 1000)])
def test_chunked_logprobs_and_entropy_match_full_logits_values_and_gradients(
    temperature: float, chunk: int
) -> None:
    g = torch.Generator().manual_seed(0)
    n, h, v = 23, 16, 50  # 23 tokens: the chunks do not divide them
    hidden = torch.randn(2, n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (2, n), generator=g)
    c_lp = torch.randn(2, n, generator=g, dtype=torch.float64)  # arbitrary upstream gradients
    c_ent = torch.randn(2, n, generator=g, dtype=torch.float64)

    logits = (hidden @ weight.t()) / temperature
    lp_full = logprobs_from_logits(logits, targets).double()
    ent_full = entropy_from_logits(logits).double()
    (lp_full * c_lp + ent_full * c_ent).sum().backward()
    want = (hidden.grad.clone(), weight.grad.clone())  # type: ignore[union-attr]
    hidden.grad, weight.grad = None, None

    lp, ent = chunked_logprobs(
        hidden, weight, targets, temperature=temperature, with_entropy=True, chunk_tokens=chunk
    )
    assert ent is not None and lp.dtype == torch.float32
    assert torch.allclose(lp.double(), lp_full, atol=1e-5) and torch.allclose(
        ent.double(), ent_full, atol=1e-5
    )
    (lp.double() * c_lp + ent.double() * c_ent).sum().backward()
    assert torch.allclose(hidden.grad, want[0], rtol=1e-4, atol=1e-4)  # type: ignore[arg-type]
    assert torch.allclose(weight.grad, want[1], rtol=1e-4, atol=1e-4)  # type: ignore[arg-type]


def test_chunked_logprobs_without_entropy_and_a_tied_head() -> None:
    """A tied embedding: the head's gradient and the embedding's gradient land in one tensor."""
    g = torch.Generator().manual_seed(1)
    emb = torch.nn.Embedding(30, 8).double()
    ids = torch.randint(0, 30, (3, 9), generator=g)
    targets = torch.randint(0, 30, (3, 9), generator=g)
    lp_full = logprobs_from_logits(emb(ids) @ emb.weight.t(), targets)
    lp_full.sum().backward()
    want = emb.weight.grad.clone()  # type: ignore[union-attr]
    emb.weight.grad = None
    lp, ent = chunked_logprobs(emb(ids), emb.weight, targets, chunk_tokens=4)
    assert ent is None and torch.allclose(lp, lp_full.float(), atol=1e-6)
    lp.sum().backward()
    assert torch.allclose(emb.weight.grad, want, atol=1e-6)  # type: ignore[arg-type]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(
            torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), temperature=0
        )
    with pytest.raises(ValueError, match="disagree"):
        chunked_logprobs(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long))


def _spread_batch(n: int = 40, seed: int = 0) -> Any:
    rng = random.Random(seed)
    samples = [
        Sample(
            [rng.randrange(4, 40) for _ in range(rng.randint(3, 12))],
            [rng.randrange(4, 40) for _ in range(rng.randint(1, 30))],
            f"g{i // 4}",
            0,
            score=float(i % 2),
        )
        for i in range(n)
    ]
    return collate(samples, pad_id=0)


def test_token_micro_batches_cover_every_row_once_within_budget_and_cut_padding() -> None:
    batch = _spread_batch()
    plens, rlens = row_lengths(batch)
    budget = 128
    groups = token_micro_batches(plens, rlens, budget)
    assert sorted(i for grp in groups for i in grp) == list(range(batch.size))
    for grp in groups:
        width = max(plens[i] for i in grp) + max(rlens[i] for i in grp)
        assert len(grp) * width <= budget or len(grp) == 1
    real = sum(plens) + sum(rlens)
    rectangular = batch.input_ids.numel()
    packed = padded_tokens(plens, rlens, groups)
    assert real <= packed < rectangular
    assert (packed - real) / packed < 0.5 * (
        rectangular - real
    ) / rectangular  # at least half the padding gone
    with pytest.raises(ValueError, match="max_tokens"):
        token_micro_batches(plens, rlens, 0)


def test_trimmed_micro_batches_give_the_same_logprobs_as_the_full_batch() -> None:
    from transformers import AutoModelForCausalLM

    from rlkube.runtime.models.tiny import tiny_qwen2_config
    from rlkube.runtime.trainer.policy import response_logits

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(40, hidden_size=64, num_heads=1)).eval()
    batch = _spread_batch(12, seed=3)
    batch.extras["advantages"] = torch.randn(batch.size, batch.responses.shape[1])
    with torch.no_grad():
        full = logprobs_from_logits(response_logits(model, batch), batch.responses) * batch.response_mask
        out = torch.zeros_like(full)
        plens, rlens = row_lengths(batch)
        for rows in token_micro_batches(plens, rlens, 64):
            mb = trim_rows(batch, rows)
            assert mb.extras["advantages"].shape == mb.responses.shape
            assert mb.input_ids.shape[1] == max(plens[i] for i in rows) + max(rlens[i] for i in rows)
            lp = logprobs_from_logits(response_logits(model, mb), mb.responses) * mb.response_mask
            scatter_rows(out, rows, lp)
    assert torch.allclose(out, full, atol=1e-5)
