"""Both samplers (Gumbel-max, inverse CDF) draw exactly from softmax(logits / T), token after token.

Seeds are pinned (the sampler is a pure function of logits and seeds), so every statistic here is
one fixed number: the bounds sit six standard deviations above a chi-square's mean, far from what a
correct sampler gives and far below what a biased one does. The extreme-hash test fails on the
24-bit uniforms ``gumbel_noise`` once used (one hash in 2**24 gave u == 1.0, infinite noise, and a
token drawn whatever its probability); the Triton kernel's copy of that maths is checked in
``test_hf_decode``.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlkube.runtime.rollout import kernels
from rlkube.runtime.rollout.base import SamplingParams, sample_seed

_M32 = 0xFFFFFFFF


def _inverse_fmix32(h: int) -> int:
    """The input ``x`` with ``kernels.fmix32(x) == h`` (murmur3's finaliser is a bijection)."""
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & _M32
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & _M32
    return h ^ (h >> 16)


def seed_hashing_to(h: int, vocab_index: int) -> int:
    """A row seed whose hash at ``vocab_index`` is ``h`` (see ``kernels.gumbel_noise``)."""
    return _inverse_fmix32(h) ^ ((vocab_index * kernels._VOCAB_MIX) & _M32)


def _chi2_bound(df: int) -> float:
    return df + 6.0 * math.sqrt(2.0 * df)


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells expecting >= 5 draws, and its degrees of freedom."""
    keep = expected >= 5
    stat = float(((counts.double() - expected) ** 2 / expected)[keep].sum())
    return stat, int(keep.sum()) - 1


def test_extreme_hashes_give_finite_noise_and_never_pick_an_impossible_token() -> None:
    vocab, v = 1000, 700
    for h in (_M32, _M32 - 0xFF, 0, 0xFF):
        seed = seed_hashing_to(h, v)
        assert int(kernels.fmix32(torch.tensor(seed ^ ((v * kernels._VOCAB_MIX) & _M32)))) == h
        g = kernels.gumbel_noise(torch.tensor([seed]), vocab)
        assert torch.isfinite(g).all(), (hex(h), g[0, v])
        # the kernel skips blocks whose best logit plus GUMBEL_BOUND cannot win: no noise reaches it
        assert float(g.max()) < kernels.GUMBEL_BOUND, (hex(h), float(g.max()))
    top = kernels.gumbel_noise(torch.tensor([seed_hashing_to(_M32, v)]), vocab)[0, v]
    assert 16.6 < float(top) < kernels.GUMBEL_BOUND  # the largest noise is 24 ln 2 = 16.64
    # Token 0 holds all the mass; token v's noise is the largest the hash can give.
    logits = torch.full((1, vocab), -40.0)
    logits[0, 0] = 40.0
    seed = torch.tensor([seed_hashing_to(_M32, v)])
    tok, lp = kernels.sample_tokens_ref(logits, torch.ones(1), seed)
    assert tok.tolist() == [0] and abs(float(lp)) < 1e-6


@pytest.mark.parametrize("method", sorted(kernels.SAMPLE_REFS))
def test_token_frequencies_match_softmax_over_temperature(method: str) -> None:
    """17 tokens, then 1,300 (three of the inverse CDF's blocks, the last one ragged)."""
    g = torch.Generator().manual_seed(0)
    n = 200_000
    seeds = kernels.row_seeds(torch.arange(n) * 7919 + 12345, torch.zeros(n, dtype=torch.long))
    sample = kernels.SAMPLE_REFS[method]
    cases = ((17, 0.5, 1.0, n), (17, 2.0, 1.0, n), (17, 2.0, 0.7, n), (17, 4.0, 1.3, n))
    cases += ((1300, 1.0, 0.8, n // 4),)
    for vocab, scale, temp, draws in cases:
        logits = torch.randn(vocab, generator=g) * scale
        tok, lp = sample(logits.expand(draws, -1), torch.full((draws,), temp), seeds[:draws])
        want = draws * torch.softmax(logits.double() / temp, -1)
        stat, df = _chi2(torch.bincount(tok, minlength=vocab), want)
        assert stat < _chi2_bound(df), (vocab, scale, temp, stat, df)
        # the log-probability returned is the raw one (before temperature) of the token chosen
        assert torch.allclose(lp, torch.log_softmax(logits, -1)[tok], atol=1e-6)


@pytest.mark.parametrize("method", sorted(kernels.SAMPLE_REFS))
def test_tokens_of_a_sample_and_samples_of_a_group_are_independent(method: str) -> None:
    """Joint frequencies of (token i, token i+1) of one sample, and of (sample j, sample k) of one
    prompt, equal the product of the marginals: the streams the trainer's seeds give do not repeat."""
    g = torch.Generator().manual_seed(1)
    vocab, prompts, group = 17, 30_000, 8
    logits = torch.randn(vocab, generator=g) * 1.5
    p = torch.softmax(logits.double(), -1)
    params = [SamplingParams(n=group, seed=42 * 1_000_003 + i) for i in range(prompts)]
    keys = torch.tensor([sample_seed(sp, j) & ((1 << 62) - 1) for sp in params for j in range(group)])  # type: ignore[operator]
    n = keys.numel()
    toks = []
    for counter in range(3):
        seeds = kernels.row_seeds(keys, torch.full((n,), counter, dtype=torch.long))
        toks.append(kernels.SAMPLE_REFS[method](logits.expand(n, -1), torch.ones(n), seeds)[0])

    def joint(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
        counts = torch.zeros(vocab * vocab, dtype=torch.long).index_add_(0, a * vocab + b, torch.ones_like(a))
        return _chi2(counts, len(a) * (p[:, None] * p[None, :]).flatten())

    pairs = {
        "token 0, token 1": (toks[0], toks[1]),
        "token 1, token 2": (toks[1], toks[2]),
        "sample 0, sample 1": (toks[0].view(prompts, group)[:, 0], toks[0].view(prompts, group)[:, 1]),
        "sample 2, sample 7": (toks[1].view(prompts, group)[:, 2], toks[1].view(prompts, group)[:, 7]),
    }
    for name, (a, b) in pairs.items():
        stat, df = joint(a, b)
        assert stat < _chi2_bound(df), (name, stat, df)


def test_the_cdf_kernels_start_up_check_accepts_correct_draws_and_refuses_wrong_ones() -> None:
    """The check a GPU runs before using the inverse-CDF kernel: the reference's draws pass (in
    float64, with a slack for float32 sums), a token moved out of its row's interval, a wrong greedy
    token or a wrong log-probability do not."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 3000, generator=g) * 3
    temp = torch.tensor([0.0, 1.0, 1.0, 0.7, 1.3, 1.0, 2.0, 1.0])
    seeds = torch.randint(0, 2**32, (8,), generator=g)
    tok, lp = kernels.sample_tokens_cdf_ref(x, temp, seeds)
    assert kernels._cdf_check(x, temp, seeds, tok, lp) is None
    for row, shift in ((1, 1500), (0, 1)):  # a sampled row, the greedy row
        bad = tok.clone()
        bad[row] = (bad[row] + shift) % 3000
        assert "1 of 8 tokens off" in str(kernels._cdf_check(x, temp, seeds, bad, lp))
    assert "logprob error" in str(kernels._cdf_check(x, temp, seeds, tok, lp + 0.01))
