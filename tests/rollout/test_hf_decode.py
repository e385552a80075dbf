"""The hf decoder's fast paths on the CPU: batch buckets, batched prefill, one-pass sampling, kernels.

The Triton kernels are GPU code; here they run in Triton's interpreter (``TRITON_INTERPRET=1``, in a
subprocess, since the flag is read when a kernel is defined) against their PyTorch references, and
the whole engine with the kernels switched on must give the same tokens and log-probabilities as
the engine without them. On a GPU the decoder repeats a self-check at start-up (bf16, which the
interpreter cannot run) and falls back to PyTorch if a kernel disagrees.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlkube.runtime.rollout import hf_decode, kernels
from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
from rlkube.runtime.rollout.hf import HFEngine, teacher_forced_logprobs
from rlkube.runtime.rollout.hf_decode import StaticDecoder, batch_buckets

from .test_sampler_distribution import seed_hashing_to

ROOT = Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 1e-4


def _model(vocab: int = 40, hidden: int = 128, heads: int = 2, kv: int = 1) -> Any:
    from transformers import AutoModelForCausalLM

    from rlkube.runtime.models.tiny import tiny_qwen2_config

    torch.manual_seed(0)
    cfg = tiny_qwen2_config(vocab, hidden_size=hidden, num_heads=heads, num_kv_heads=kv)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def model() -> Any:
    return _model()


def test_batch_buckets_cover_every_row_count() -> None:
    assert batch_buckets(512) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert batch_buckets(64) == [8, 16, 24, 32, 48, 64]
    assert batch_buckets(5) == [5] and batch_buckets(10) == [8, 10]


def test_batched_prefill_equals_one_prompt_at_a_time(model: Any) -> None:
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 9], [2, 3, 4, 5]]
    groups = [[0, 1], [2], [3, 4, 5]]
    together = StaticDecoder(model, num_slots=6, max_seq_len=32, max_new_tokens=8)
    alone = StaticDecoder(model, num_slots=6, max_seq_len=32, max_new_tokens=8)
    logits = together.prefill(prompts, groups)
    assert together.prefill_forwards == 1  # every prompt in one forward
    for i, (p, g) in enumerate(zip(prompts, groups, strict=True)):
        want = alone.prefill([p], [g])[0]
        assert torch.allclose(logits[i], want, atol=1e-5)
        for layer in range(len(together.layers)):
            for slot in g:  # each sample of the group holds the prompt's KV
                got_k = together.k_cache[layer][slot, :, : len(p)]
                assert torch.allclose(got_k, alone.k_cache[layer][g[0], :, : len(p)], atol=1e-5)
                got_v = together.v_cache[layer][slot, :, : len(p)]
                assert torch.allclose(got_v, alone.v_cache[layer][g[0], :, : len(p)], atol=1e-5)
    # a small token budget splits the prompts into several forwards with the same result
    chunked = StaticDecoder(model, num_slots=6, max_seq_len=32, max_new_tokens=8, max_prefill_tokens=8)
    assert torch.allclose(chunked.prefill(prompts, groups), logits, atol=1e-5)
    assert chunked.prefill_forwards == 2  # [2, 4 tokens padded to 4] then [7 tokens]: 8 each


def test_prefill_chunks_take_prompts_by_length_so_little_is_padding(model: Any) -> None:
    """Prompts of 2, 30, 3 and 29 tokens under a 64-token budget: in arrival order the chunks
    would be [2, 30] and [3, 29], 118 positions run; by length they are [2, 3] and [29, 30], 66.
    The logits still come back in the prompts' order."""
    prompts = [[1 + t % 7 for t in range(n)] for n in (2, 30, 3, 29)]
    groups = [[0], [1], [2], [3]]
    dec = StaticDecoder(model, num_slots=4, max_seq_len=40, max_new_tokens=4, max_prefill_tokens=64)
    logits = dec.prefill(prompts, groups)
    assert (dec.prefill_forwards, dec.prefill_padded_tokens) == (2, 2 * 3 + 2 * 30)
    alone = StaticDecoder(model, num_slots=4, max_seq_len=40, max_new_tokens=4)
    for i, (p, g) in enumerate(zip(prompts, groups, strict=True)):
        assert torch.allclose(logits[i], alone.prefill([p], [g])[0], atol=1e-5)


def test_one_prefill_per_prompt_group(model: Any) -> None:
    reqs = [
        RolloutRequest(f"g{i}", p, SamplingParams(n=4, max_tokens=6, seed=i))
        for i, p in enumerate([[1, 2], [3, 4, 5]])
    ]
    with HFEngine(model=model, num_slots=8, max_seq_len=32) as eng:
        out = eng.generate(reqs)
        assert eng.decoder.prefill_forwards == 1  # 2 prompts x 4 samples: one batched forward
    for c in out:
        tf = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), tf, atol=LOGPROB_ATOL)


def _mixed_length_requests() -> list[RolloutRequest]:
    prompts = [[1, 5, 6, 7], [1, 9], [1, 4, 4, 4, 4, 4, 4, 12, 13], [2, 3]]
    return [
        RolloutRequest(f"r{i}_{k}", p, SamplingParams(n=2, temperature=1.0, max_tokens=m, seed=100 * i + k))
        for i, p in enumerate(prompts)
        for k, m in enumerate([3, 11, 29])
    ]


@pytest.mark.parametrize("sampling", sorted(kernels.SAMPLE_REFS))
def test_finished_samples_free_their_rows_and_the_batch_shrinks(model: Any, sampling: str) -> None:
    """24 samples of 3, 11 and 29 tokens: steps move from 24 rows to 16 to 8, live samples are
    moved down, and every sample is exactly what it is when decoded alone (either sampler)."""
    reqs = _mixed_length_requests()
    with HFEngine(model=model, num_slots=24, max_seq_len=64, sync_every=2, sampling=sampling) as eng:
        together = eng.generate(reqs)
        used = eng.decoder.steps_by_bucket
        assert set(used) == {8, 16, 24} and used[8] > used[24]  # the long tail runs on 8 rows
        assert eng.decoder.rows_moved > 0
    with HFEngine(model=model, num_slots=2, max_seq_len=64, sampling=sampling) as eng:
        alone = [eng.generate([r]) for r in reqs]
    flat = [c for out in alone for c in out]
    assert [c.token_ids for c in together] == [c.token_ids for c in flat]
    for c in together:
        assert len(c.token_ids) == c.params.max_tokens
        tf = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), tf, atol=LOGPROB_ATOL)


def test_tokens_harvested_behind_each_chunk_equal_tokens_read_at_collection(model: Any) -> None:
    """More samples than slots (rows refilled while others run), mixed lengths, a stop token and
    2-step chunks: completions built from the per-chunk copies are exactly those read from the
    device at collection, and the copies carry every token."""
    reqs = _mixed_length_requests() + [
        RolloutRequest(f"s{i}", [1, 3 + i], SamplingParams(n=3, max_tokens=25, stop_token_ids=[7], seed=i))
        for i in range(4)
    ]
    out, routes = {}, {}
    for harvest in (True, False):
        with HFEngine(model=model, num_slots=16, max_seq_len=64, sync_every=2, harvest_tokens=harvest) as eng:
            out[harvest] = eng.generate(reqs)
            routes[harvest] = dict(eng.tokens_by_route)
            assert eng.decoder.rows_moved > 0
    fields = ("request_id", "sample_index", "token_ids", "logprobs", "token_versions", "finish_reason")
    on, off = ([tuple(getattr(c, f) for f in fields) for c in out[k]] for k in (True, False))
    assert on == off
    assert {c.finish_reason for c in out[True]} == {"stop", "length"}
    total = sum(len(c.token_ids) for c in out[True])
    assert routes[False] == {"harvest": 0, "collect": total}
    assert routes[True] == {"harvest": total, "collect": 0}  # collection read nothing more


def test_finished_flags_read_before_the_chunk_ends_give_the_same_samples(model: Any) -> None:
    """The host reads the finished flags ``flag_lag`` steps before a chunk's end and plans the next
    chunk while those steps run: samples that stop in them are collected a chunk later, with the
    same tokens and finish reasons as when the flags are read at the end, and log-probs to float32
    rounding (rows stay longer, so some steps run over a larger batch bucket). Samples seen
    finished in the early flags free their rows at once and are completed from the chunk's token
    copy, read once the next chunk runs (nothing read from the device for them)."""
    reqs = _mixed_length_requests() + [
        RolloutRequest(f"s{i}", [1, 3 + i], SamplingParams(n=3, max_tokens=25, stop_token_ids=[7], seed=i))
        for i in range(4)
    ]
    out, reads, early, routes = {}, {}, {}, {}
    for lag in (0, 1, 3):
        with HFEngine(model=model, num_slots=16, max_seq_len=64, sync_every=4, flag_lag=lag) as eng:
            out[lag] = eng.generate(reqs)
            reads[lag] = dict(eng.flag_reads)
            early[lag], routes[lag] = eng.finished_from_harvest, dict(eng.tokens_by_route)
    fields = ("request_id", "sample_index", "token_ids", "token_versions", "finish_reason")
    want = [tuple(getattr(c, f) for f in fields) for c in out[0]]
    assert {c.finish_reason for c in out[0]} == {"stop", "length"}
    for lag in (1, 3):
        assert [tuple(getattr(c, f) for f in fields) for c in out[lag]] == want, lag
        for a, b in zip(out[0], out[lag], strict=True):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        assert reads[lag]["early"] > reads[lag]["end"] > 0, reads[lag]  # the end: short chunks, the last
        assert early[lag] > 18, early  # most of the 36 samples
        assert routes[lag] == routes[0] == {"harvest": sum(len(c.token_ids) for c in out[0]), "collect": 0}
    assert reads[0]["early"] == 0 and early[0] == 0
    with pytest.raises(ValueError, match="flag_lag"):
        HFEngine(model=model, num_slots=2, max_seq_len=64, flag_lag=-1)


def test_gumbel_sampling_is_exact_reproducible_and_greedy_at_zero() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 2
    n, temp = 20000, 0.8
    seeds = kernels.row_seeds(torch.full((n,), 12345), torch.arange(n))
    tok, lp = kernels.sample_tokens_ref(logits.expand(n, -1), torch.full((n,), temp), seeds)
    freq = torch.bincount(tok, minlength=12).float() / n
    assert 0.5 * (freq - torch.softmax(logits[0] / temp, -1)).abs().sum() < 0.02  # total variation
    assert torch.allclose(lp, torch.log_softmax(logits[0], -1)[tok], atol=1e-6)  # raw, before T
    again, _ = kernels.sample_tokens_ref(logits.expand(n, -1), torch.full((n,), temp), seeds)
    assert torch.equal(tok, again)
    greedy, _ = kernels.sample_tokens_ref(logits.expand(3, -1), torch.zeros(3), seeds[:3])
    assert greedy.tolist() == [int(logits.argmax())] * 3
    keep = kernels.top_p_keep(logits.expand(n, -1), torch.full((n,), temp), torch.full((n,), 0.5))
    nucleus, _ = kernels.sample_tokens_ref(logits.expand(n, -1), torch.full((n,), temp), seeds, keep)
    assert set(nucleus.tolist()) <= set(torch.nonzero(keep[0]).flatten().tolist())
    assert Counter(nucleus.tolist()).most_common(1)[0][0] == int(logits.argmax())


# inductor's CPU backend still calls torch.jit.script_method, which warns in torch 2.13
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_compiled_seed_hash_gives_the_eager_seeds_bit_for_bit() -> None:
    """The decode step compiles ``row_seeds`` (one kernel instead of ~25 integer ones); its
    multiplies wrap past 2**63 for large keys, and the 32-bit seeds must still be the eager ones,
    or a compiled step would sample other tokens than the same request elsewhere."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**62, (4096,), generator=g)
    keys[:4] = torch.tensor([0, 2**62 - 1, 2**32 - 1, 2**32])
    counters = torch.randint(0, 2**20, (4096,), generator=g)
    assert torch.equal(torch.compile(kernels.row_seeds)(keys, counters), kernels.row_seeds(keys, counters))


KERNEL_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from rlkube.runtime.rollout import kernels as K
    cpu = torch.device("cpu")
    out = {}
    for dtype in (torch.float32, torch.float16):
        att = K.TritonDecodeAttention(5, 2, 7, 64, 600, cpu)  # 14 query heads on 2 KV heads
        out[f"attention_{dtype}"] = K.self_check("attention", att, cpu, rows=5, n_kv=2, group=7, d=64,
                                                seq=600, dtype=dtype)
        smp = K.TritonSampler(6, 20000, cpu)
        out[f"sample_{dtype}"] = K.self_check("sample", smp, cpu, rows=6, vocab=20000, dtype=dtype)
        out[f"silu_{dtype}"] = K.self_check("silu", K.silu_mul, cpu, rows=3, inter=700, dtype=dtype)
    # exact agreement, ties aside: same tokens, log-probabilities to float32 rounding
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 20000, generator=g) * 4
    seeds = K.row_seeds(torch.arange(6) * 977, torch.arange(6))
    t = torch.tensor([0.0, 0.5, 1.0, 1.0, 1.5, 2.0])
    tok, lp = K.TritonSampler(6, 20000, cpu)(x, t, seeds)
    rtok, rlp = K.sample_tokens_ref(x, t, seeds)
    out["same_tokens"] = tok.tolist() == rtok.tolist()
    out["lp_err"] = float((lp - rlp).abs().max())
    # peaked logits (Zipf over the vocabulary, a spike): most blocks are skipped as unable to win,
    # and the tokens must still be exactly the reference's
    rank = torch.randperm(20000, generator=g).float() + 1
    x = torch.stack([-2.0 * rank.log(), -3.0 * rank.log(), -1.0 * rank.log()] * 2)
    x[3, 12345] = 5.0
    seeds = K.row_seeds(torch.arange(6) * 31 + 7, torch.arange(6))
    t = torch.tensor([1.0, 0.7, 1.0, 0.0, 1.5, 1.0])
    tok, lp = K.TritonSampler(6, 20000, cpu)(x, t, seeds)
    rtok, rlp = K.sample_tokens_ref(x, t, seeds)
    out["peaked_same_tokens"] = tok.tolist() == rtok.tolist()
    out["peaked_lp_err"] = float((lp - rlp).abs().max())
    # the largest hash at token 700 must not beat a token holding all the mass
    x = torch.full((1, 20000), -40.0)
    x[0, 0] = 40.0
    tok, _ = K.TritonSampler(1, 20000, cpu)(x, torch.ones(1), torch.tensor([MAX_HASH_SEED]))
    out["extreme_hash_token"] = tok.item()
    # the screen (the noise's two logs only in blocks where some hash leaves a chance) never drops
    # a winner: token 7000, six blocks after the chunk's best (token 5), is set to beat it by 1e-5
    # or to miss it by 1e-5; with the screen on, off, and in the reference. Rows 2-3 hash token
    # 7000 to u = 1 - 1.5 / 2**23, where the screen's bound 1 - u is closest to -log(u).
    seeds = K.row_seeds(torch.arange(4) + 99, torch.zeros(4, dtype=torch.long))
    seeds[2:] = TIGHT_HASH_SEED
    noise = K.gumbel_noise(seeds, 20000)
    x = torch.full((4, 20000), -30.0)
    x[:, 5] = 0.0
    t = torch.tensor([1.0, 0.5, 1.0, 0.5])
    margin = torch.tensor([1e-5, -1e-5, 1e-5, -1e-5])
    x[:, 7000] = (x[:, 5] / t + noise[:, 5] - noise[:, 7000] + margin) * t
    picks = {}
    for name, smp in (("on", K.TritonSampler(4, 20000, cpu)),
                      ("off", K.TritonSampler(4, 20000, cpu, screen=False)),
                      ("reuse-exp", K.TritonSampler(4, 20000, cpu, reuse_exp=1)),
                      ("int-to-float", K.TritonSampler(4, 20000, cpu, bitcast_uniform=False))):
        picks[name] = smp(x, t, seeds)[0].tolist()
    picks["reference"] = K.sample_tokens_ref(x, t, seeds)[0].tolist()
    out["screen_picks"] = picks
    # every row at temperature 1, no per-row check (rows 0 and 2 above)
    rows = torch.tensor([0, 2])
    smp = K.TritonSampler(2, 20000, cpu, reuse_exp=2)
    out["reuse_all_picks"] = smp(x[rows], t[rows], seeds[rows])[0].tolist()
    for mode in (1, 2):
        smp = K.TritonSampler(6, 20000, cpu, reuse_exp=mode)
        shape = {"rows": 6, "vocab": 20000, "dtype": torch.float32}
        out[f"sample_reuse_{mode}"] = K.self_check("sample", smp, cpu, **shape)
    # the MLP's silu(gate) * up: rows x column blocks, a ragged last block
    gu = torch.randn(5, 2 * 1500, generator=g) * 3
    out["silu_err"] = float((K.silu_mul(gu) - K.silu_mul_ref(gu)).abs().max())
    # the same with the MLP norm folded: each row's 1 / rms from the residual (a ragged width)
    x = torch.randn(5, 96, generator=g) * 7
    got, ref = K.scaled_silu_mul(gu, x, 1e-6), K.scaled_silu_mul_ref(gu, x, 1e-6)
    out["scaled_silu_err"] = float((got - ref).abs().max())
    out["scaled_silu_check"] = K.self_check(
        "scaled_silu", K.scaled_silu_mul, cpu, rows=3, inter=700, hidden=96, dtype=torch.float32
    )
    # folded weight on the raw residual == the norm, then the weight (float32: to rounding)
    w, norm = torch.randn(2 * 1500, 96, generator=g), torch.rand(96, generator=g) + 0.5
    want = K.silu_mul_ref(torch.nn.functional.rms_norm(x, (96,), norm, 1e-6) @ w.T)
    folded = K.scaled_silu_mul_ref(x @ K.fold_norm_weight(w, norm).T, x, 1e-6)
    out["fold_err"] = float((folded - want).abs().max() / want.abs().max())  # relative
    print(json.dumps(out))
    """
)

ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from transformers import AutoModelForCausalLM
    from rlkube.runtime.models.tiny import tiny_qwen2_config
    from rlkube.runtime.rollout.hf import HFEngine, teacher_forced_logprobs
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(40, hidden_size=128, num_heads=2)).eval()
    reqs = [RolloutRequest(f"r{i}_{m}", p, SamplingParams(n=2, max_tokens=m, seed=i * 10 + m))
            for i, p in enumerate([[1, 5, 6, 7], [1, 9, 8]]) for m in (3, 9)]
    res = {}
    for sampling in ("gumbel", "cdf"):
        outs = {}
        for k in (False, True):
            with HFEngine(model=model, num_slots=8, max_seq_len=32, kernels=k, linear_max_rows=8,
                          sampling=sampling) as eng:
                outs[k] = (eng.generate(reqs), eng.decoder.kernels_used)
        a, b = outs[False][0], outs[True][0]
        err = max(max(abs(x - y) for x, y in zip(p.logprobs, q.logprobs)) for p, q in zip(a, b))
        tf = max(float((teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)
                        - torch.tensor(c.logprobs)).abs().max()) for c in b)
        same = [c.token_ids for c in a] == [c.token_ids for c in b]
        res[sampling] = {"kernels": outs[True][1], "same_tokens": same, "lp_err": err, "tf_err": tf,
                         "tokens": [c.token_ids for c in b]}
    print(json.dumps(res))
    """
)

# Two prompts past one 64-position block (so a group really shares), one prefill each. Prompt A's
# first sample (the group's lowest row, which the others read) stops after 2 tokens while its 3
# siblings go on; its row is then refilled with prompt B (8 samples, 6 slots), whose K/V differs,
# so followers still reading that row would decode other tokens.
SHARE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from transformers import AutoModelForCausalLM
    from rlkube.runtime.models.tiny import tiny_qwen2_config
    from rlkube.runtime.rollout.hf import HFEngine
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(40, hidden_size=128, num_heads=2)).eval()
    a = [1 + (7 * i) % 37 for i in range(70)]
    b = [2 + (5 * i) % 31 for i in range(131)]
    reqs = [RolloutRequest("a_short", a, SamplingParams(n=1, max_tokens=2, seed=1)),
            RolloutRequest("a_long", a, SamplingParams(n=3, max_tokens=10, seed=2)),
            RolloutRequest("b", b, SamplingParams(n=4, max_tokens=6, seed=3))]
    out, calls = {}, {False: [], True: []}
    for share in (False, True):
        with HFEngine(model=model, num_slots=6, max_seq_len=160, kernels=True, sync_every=2,
                      share_prompt_reads=share) as eng:
            setter = eng.decoder.set_shared_prompts
            def spy(rows, lens, setter=setter, share=share):
                calls[share].append((list(rows), list(lens)))
                setter(rows, lens)
            eng.decoder.set_shared_prompts = spy
            out[share] = eng.generate(reqs)
            used = eng.decoder.kernels_used
    same = [c.token_ids for c in out[False]] == [c.token_ids for c in out[True]]
    lp_same = all(p.logprobs == q.logprobs for p, q in zip(out[False], out[True]))
    print(json.dumps({"kernels": used, "same_tokens": same, "same_logprobs": lp_same,
                      "calls": calls[True], "calls_off": calls[False]}))
    """
)


def test_the_samples_of_a_prompt_read_its_kv_from_one_row_and_decode_exactly_the_same(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    """Prompt sharing in the attention kernel (interpreter): the same tokens and bitwise the same
    logprobs as every row reading its own copy, while the group's first row stops and is reused."""
    out = triton_interpret(SHARE_SCRIPT)
    assert out["kernels"]["attention"] == "triton"
    assert out["same_tokens"] and out["same_logprobs"]
    calls = [(rows, lens) for rows, lens in out["calls"]]
    assert out["calls_off"] and all(rows == lens == [] for rows, lens in out["calls_off"])  # off: own K/V
    # first: A's samples in rows 0-3 read row 0 (70 positions); B's first two in rows 4-5 read row 4
    assert calls[0] == ([0, 0, 0, 0, 4, 4], [0, 70, 70, 70, 0, 131])
    # row 0 stopped and took B's third sample (another prefill: it reads its own); A's others read row 1
    assert calls[1] == ([0, 1, 1, 1, 4, 4], [0, 0, 70, 70, 0, 131])


def test_triton_kernels_match_their_references_in_the_interpreter(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    assert kernels.HAVE_TRITON, "triton is part of the test environment (torch's dependency)"
    tight = seed_hashing_to(((2**23 - 2) << 9) | 0x1FF, 7000)
    script = KERNEL_SCRIPT.replace("MAX_HASH_SEED", str(seed_hashing_to(0xFFFFFFFF, 700)))
    out = triton_interpret(script.replace("TIGHT_HASH_SEED", str(tight)))
    for key in (
        "attention_torch.float32",
        "attention_torch.float16",
        "sample_torch.float32",
        "sample_torch.float16",
        "silu_torch.float32",
        "silu_torch.float16",
    ):
        assert out[key] is None, (key, out[key])
    assert out["same_tokens"] and out["lp_err"] < 1e-5
    assert out["peaked_same_tokens"] and out["peaked_lp_err"] < 1e-5
    assert out["extreme_hash_token"] == 0
    assert out["silu_err"] < 1e-5
    assert out["scaled_silu_err"] < 1e-5 and out["scaled_silu_check"] is None
    assert out["fold_err"] < 1e-6
    variants = ("on", "off", "reuse-exp", "int-to-float", "reference")
    assert out["screen_picks"] == {k: [7000, 5, 7000, 5] for k in variants}
    assert out["reuse_all_picks"] == [7000, 7000]
    assert out["sample_reuse_1"] is None and out["sample_reuse_2"] is None


CDF_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from rlkube.runtime.rollout import kernels as K
    cpu = torch.device("cpu")
    out = {}
    for dtype in (torch.float32, torch.float16):
        smp = K.TritonSampler(6, 20000, cpu, method="cdf")
        out[f"check_{dtype}"] = K.self_check("sample", smp, cpu, rows=6, vocab=20000, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 20000, generator=g) * 4
    x[2, :1536] = float("-inf")  # whole blocks without mass
    x[5, 19990:] = float("-inf")
    seeds = K.row_seeds(torch.arange(8) * 131, torch.arange(8))
    t = torch.tensor([0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 1.0, 0.7])
    rtok, rlp = K.sample_tokens_cdf_ref(x, t, seeds)
    out["ref_tokens"] = rtok.tolist()
    # the entries per program must not change a token: the block sums are the same blocks
    launches = (("8k", {"chunk": 8192}), ("16k", {"chunk": 16384}), ("1k", {"chunk": 1024}))
    for name, kw in launches:
        tok, lp = K.TritonSampler(8, 20000, cpu, method="cdf", **kw)(x, t, seeds)
        out[f"tokens_{name}"] = tok.tolist()
        out[f"lp_err_{name}"] = float((lp - rlp).abs().max())
    # u at its largest, 1 - 2**-24, with the mass on token 3, 1.1e-7 of it on token 4 and the rest of
    # the vocabulary at -inf: the top of the CDF is token 4, never a token without mass
    x = torch.full((1, 20000), float("-inf"))
    x[0, 3] = 0.0
    x[0, 4] = -16.0
    tok, _ = K.TritonSampler(1, 20000, cpu, method="cdf")(x, torch.ones(1), torch.tensor([TOP_U_SEED]))
    out["top_u_token"] = tok.item()
    out["top_u_ref"] = K.sample_tokens_cdf_ref(x, torch.ones(1), torch.tensor([TOP_U_SEED]))[0].item()
    print(json.dumps(out))
    """
)


def _cdf_seed_with_u_bits(k: int) -> int:
    """A row seed whose ``cdf_uniform`` takes the 23 bits ``k`` (the hash inverted)."""
    from .test_sampler_distribution import _inverse_fmix32

    return _inverse_fmix32((k << 9) | 0x1FF) ^ kernels._CDF_SALT


def test_the_cdf_kernel_draws_the_references_tokens_whatever_its_launch(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    """Inverse-CDF sampling (interpreter): the kernel passes its self-check, draws the reference's
    tokens at every temperature (greedy included) and with blocks of no mass, whatever the entries
    per program (the warps per program stay 2: another count sums each block in another order),
    and never draws a token of zero probability when ``u`` is at its largest."""
    seed = _cdf_seed_with_u_bits(2**23 - 1)
    assert float(kernels.cdf_uniform(torch.tensor([seed]))) == 1 - 2**-24
    out = triton_interpret(CDF_SCRIPT.replace("TOP_U_SEED", str(seed)))
    assert out["check_torch.float32"] is None and out["check_torch.float16"] is None, out
    for name in ("8k", "16k", "1k"):
        assert out[f"tokens_{name}"] == out["ref_tokens"], (name, out)
        assert out[f"lp_err_{name}"] < 1e-5
    assert out["ref_tokens"][2] >= 1536 and out["ref_tokens"][5] < 19990
    assert out["top_u_token"] == out["top_u_ref"] == 4


def test_engine_with_triton_kernels_equals_engine_without(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    res = triton_interpret(ENGINE_SCRIPT)
    on = dict.fromkeys(("attention", "sampling", "silu", "linear"), "triton")
    for sampling, out in res.items():  # Gumbel-max, then the inverse CDF
        assert out["kernels"] == {**on, "gated": "torch"}, sampling  # gated_min_rows not asked for
        assert out["same_tokens"] and out["lp_err"] < 1e-5 and out["tf_err"] < LOGPROB_ATOL, (sampling, out)
    assert res["gumbel"]["tokens"] != res["cdf"]["tokens"]  # two samplers, so other draws for one seed


# Kernels on in both engines; the second runs gate/up + SiLU as one GEMM (SiLU in its epilogue)
# for buckets of >= 16 rows. 12 samples of 9 tokens, then the finished ones leave: the steps run
# in bucket 16 first, then 8, so both paths serve the same rollout.
GATED_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from transformers import AutoModelForCausalLM
    from rlkube.runtime.models.tiny import tiny_qwen2_config
    from rlkube.runtime.rollout.hf import HFEngine, teacher_forced_logprobs
    from rlkube.runtime.rollout.base import RolloutRequest, SamplingParams
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(40, hidden_size=64, num_heads=2)).eval()
    reqs = [RolloutRequest(f"r{i}", p, SamplingParams(n=4, max_tokens=9 - 3 * i, seed=i))
            for i, p in enumerate([[1, 5, 6, 7], [2, 9, 8], [3, 3, 4]])]
    outs, used, steps = {}, {}, {}
    for min_rows in (0, 16):
        with HFEngine(model=model, num_slots=16, max_seq_len=24, kernels=True,
                      gated_min_rows=min_rows) as eng:
            outs[min_rows] = eng.generate(reqs)
            used[min_rows] = (eng.decoder.kernels_used["gated"], eng.decoder.gated_min_rows)
            steps[min_rows] = eng.decoder.steps_by_bucket
    a, b = outs[0], outs[16]
    err = max(max(abs(x - y) for x, y in zip(p.logprobs, q.logprobs)) for p, q in zip(a, b))
    tf = max(float((teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)
                    - torch.tensor(c.logprobs)).abs().max()) for c in b)
    same = [c.token_ids for c in a] == [c.token_ids for c in b]
    print(json.dumps({"used": used, "same_tokens": same, "lp_err": err, "tf_err": tf,
                      "steps": {k: {str(n): c for n, c in v.items()} for k, v in steps.items()}}))
    """
)


def test_the_gated_gemm_with_silu_in_its_epilogue_decodes_the_same_tokens_and_logprobs(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    """``gated_min_rows``: large buckets run the norm, then gate/up with ``silu(gate) * up`` in the
    GEMM's epilogue (the [rows, 2 I] product never written); the engine must sample the same
    tokens with the same log-probabilities as cuBLAS + the SiLU kernel, and they must still match
    a teacher-forced forward pass."""
    out = triton_interpret(GATED_SCRIPT)
    assert out["used"] == {"0": ["torch", 0], "16": ["triton", 16]}
    assert out["steps"]["16"].get("16", 0) > 0 and out["steps"]["16"].get("8", 0) > 0, out["steps"]
    assert out["same_tokens"]
    assert out["lp_err"] < 1e-5 and out["tf_err"] < LOGPROB_ATOL, out


def test_a_negative_gated_min_rows_is_refused_naming_the_field(model: Any) -> None:
    with pytest.raises(ValueError, match="gated_min_rows must be an integer >= 0"):
        StaticDecoder(model, num_slots=4, max_seq_len=16, max_new_tokens=4, gated_min_rows=-1)


def test_a_step_records_running_rows_and_moves_on_only_those_that_continue() -> None:
    """``advance_slots`` on 4 rows: continues; samples a stop id; reaches its budget; already done."""
    tok, lp = torch.tensor([11, 7, 12, 13]), torch.tensor([-0.5, -1.0, -1.5, -2.0])
    cur_tok, pos = torch.tensor([1, 2, 3, 4]), torch.tensor([10, 20, 30, 40])
    n_gen, max_new = torch.tensor([0, 2, 4, 1]), torch.tensor([8, 8, 5, 8])
    running, stopped = torch.tensor([True, True, True, False]), torch.zeros(4, dtype=torch.bool)
    stop_ids = torch.tensor([[7, -1]] * 4)
    out_tok, out_lp = torch.zeros(4, 6, dtype=torch.long), torch.zeros(4, 6)
    hf_decode.advance_slots(
        tok, lp, torch.arange(4), cur_tok, pos, n_gen, max_new, running, stopped, stop_ids, out_tok, out_lp, 5
    )
    assert [int(out_tok[r, c]) for r, c in ((0, 0), (1, 2), (2, 4))] == [11, 7, 12]  # at each row's count
    assert out_tok[3].tolist() == [0] * 6 and float(out_lp[1, 2]) == -1.0  # a finished row writes nothing
    assert n_gen.tolist() == [1, 3, 5, 1]
    assert stopped.tolist() == [False, True, False, False]
    assert running.tolist() == [True, False, False, False]
    # only the row that goes on feeds its new token at the next position
    assert cur_tok.tolist() == [11, 2, 3, 4] and pos.tolist() == [11, 20, 30, 40]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_kv_rows_copied_as_words_carry_every_bit_of_the_element_copy(dtype: torch.dtype) -> None:
    """Prefill and row moves copy K/V rows as 8-byte words (``hf_decode._put_rows``): the cache
    after the copy equals the element-by-element copy bit for bit (NaN payloads included), for a
    source that is a strided view of a larger tensor and for a cache copying its own rows."""
    gen = torch.Generator().manual_seed(5)
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    info = torch.iinfo(bits)

    def random_bits(*shape: int) -> torch.Tensor:
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=bits).view(dtype)

    cache = random_bits(6, 2, 10, 8)
    fused = random_bits(3, 5, 7, 8)  # [prompts, heads incl. others, positions, dim]
    source = fused[:, 3:]  # a strided view: heads 3-4 of 5
    rows, take = torch.tensor([4, 0, 2, 5]), torch.tensor([2, 0, 0, 1])
    want = cache.clone()
    want[rows, :, :7] = source[take]
    got = cache.clone()
    hf_decode._put_rows(got, rows, 7, source, take)
    assert torch.equal(got.view(bits), want.view(bits))
    want[torch.tensor([1, 3]), :, :4] = want[torch.tensor([4, 2]), :, :4]
    hf_decode._put_rows(got, torch.tensor([1, 3]), 4, got, torch.tensor([4, 2]))
    assert torch.equal(got.view(bits), want.view(bits))
    words = hf_decode.as_words(cache)  # the same bytes, 8 to an element (float64 already is)
    assert words.dtype in (torch.int64, torch.float64)
    assert words.numel() * 8 == cache.numel() * cache.element_size()
    odd = random_bits(2, 3)  # 3 elements of 2 or 4 bytes make no whole word: copied as they are
    assert hf_decode.as_words(odd) is odd


def test_the_attention_split_keeps_programs_long_and_splits_only_small_grids() -> None:
    """``split_for``: one program per row and KV head over the whole cache unless the grid would be
    small, then splits of at least ``MIN_SPLIT`` positions (the policy the attention-alone bench
    measured best on an H100: splits cost a float32 partial per padded query head and a combine)."""
    att = kernels.TritonDecodeAttention(512, 2, 6, 128, 1408, torch.device("cpu"))
    assert [att.split_for(r) for r in (512, 256, 128)] == [1408] * 3  # whole cache: no combine kernel
    assert att.split_for(64) == 512 and att.split_for(8) == 512  # 128 programs: 3 splits of 512
    long = kernels.TritonDecodeAttention(64, 2, 6, 128, 20000, torch.device("cpu"))
    split = long.split_for(64)
    assert split == 8192 and 64 * 2 * -(-20000 // split) <= long.TARGET_PROGRAMS
    short = kernels.TritonDecodeAttention(8, 2, 7, 64, 320, torch.device("cpu"))
    assert short.split_for(1) == 320  # a cache within MIN_SPLIT is never split


def test_decode_attention_reference_masks_each_row_to_its_length() -> None:
    g = torch.Generator().manual_seed(0)
    q, kc, vc = (torch.randn(3, 2, 4, 16, generator=g) for _ in range(3))
    kc, vc = torch.randn(3, 2, 10, 16, generator=g), torch.randn(3, 2, 10, 16, generator=g)
    seq = torch.tensor([10, 4, 1])
    out = kernels.decode_attention_ref(q, kc, vc, seq, 10)
    for r in range(3):
        n = int(seq[r])
        want = torch.nn.functional.scaled_dot_product_attention(
            q[r : r + 1], kc[r : r + 1, :, :n], vc[r : r + 1, :, :n]
        )
        assert torch.allclose(out[r], want[0], atol=1e-5)


@pytest.mark.parametrize("fold", [True, False], ids=["summed-in-next-norm", "summed-by-own-kernel"])
def test_the_down_projection_split_k_decodes_the_same_tokens_and_logprobs(
    model: Any, monkeypatch: pytest.MonkeyPatch, fold: bool
) -> None:
    """Large buckets may run the down GEMM as slices of K summed in float32 (``down_split_min_rows``),
    the sum folded into the next norm or not; the engine must sample the same tokens with the same
    log-probabilities as the one-GEMM path."""
    calls = Counter[int]()
    real = hf_decode.split_k_partials

    def counted(h: torch.Tensor, *args: Any) -> torch.Tensor:
        calls[h.shape[0]] += 1
        return real(h, *args)

    monkeypatch.setattr(hf_decode, "split_k_partials", counted)
    reqs = [
        RolloutRequest(f"r{i}", p, SamplingParams(n=4, max_tokens=12, seed=i))
        for i, p in enumerate([[1, 5, 6, 7], [2, 9, 8], [3, 3, 4, 5, 6]])
    ]
    outs = {}
    for min_rows in (0, 8):
        with HFEngine(model=model, num_slots=16, max_seq_len=32, down_split_min_rows=min_rows) as eng:
            eng.decoder.down_split_fold = fold
            outs[min_rows] = eng.generate(reqs)
            assert eng.decoder.down_split_min_rows == min_rows
    one, split = outs[0], outs[8]
    assert set(calls) == {16}, calls  # each step of the second engine (12 rows: bucket 16), none of the first
    assert [c.token_ids for c in one] == [c.token_ids for c in split]
    pairs = zip(one, split, strict=True)
    err = max(max(abs(a - b) for a, b in zip(p.logprobs, q.logprobs, strict=True)) for p, q in pairs)
    assert err < LOGPROB_ATOL


def test_the_down_split_is_on_by_default_only_where_it_was_measured_to_win(model: Any) -> None:
    """By default the split runs on GPUs for wide MLPs (Qwen2.5-1.5B: 8960) and nowhere else: the
    0.5B MLP (4864) ran slower split on an H100, and the CPU path was never measured."""
    k = hf_decode.DOWN_SPLIT_K
    assert hf_decode.auto_down_split_min_rows(8960, "cuda") == hf_decode.DOWN_SPLIT_MIN_ROWS_DEFAULT > 0
    assert hf_decode.auto_down_split_min_rows(4864, "cuda") == 0
    assert hf_decode.auto_down_split_min_rows(8960, "cpu") == 0
    assert hf_decode.auto_down_split_min_rows(8192 * k + 1, "cuda", k) == 0  # k must divide the width
    dec = StaticDecoder(model, num_slots=4, max_seq_len=16, max_new_tokens=4)
    assert dec.down_split_min_rows == 0  # this test model on the CPU


def test_a_down_split_that_does_not_divide_the_mlp_width_is_refused_naming_the_fix(model: Any) -> None:
    inter = model.config.intermediate_size
    bad = next(k for k in range(3, 64) if inter % k)
    with pytest.raises(ValueError, match=f"down_split_k={bad} does not divide intermediate_size={inter}"):
        StaticDecoder(
            model, num_slots=4, max_seq_len=16, max_new_tokens=4, down_split_min_rows=8, down_split_k=bad
        )
    with pytest.raises(ValueError, match="down_split_min_rows must be an integer >= 0"):
        StaticDecoder(model, num_slots=4, max_seq_len=16, max_new_tokens=4, down_split_min_rows=-1)


@pytest.mark.parametrize("splits", [2, 4])
def test_residual_split_k_adds_the_whole_product_and_bias_into_the_residual(splits: int) -> None:
    g = torch.Generator().manual_seed(7)
    x, h = torch.randn(5, 6, generator=g), torch.randn(5, 16, generator=g)
    w, b = torch.randn(6, 16, generator=g), torch.randn(6, generator=g)
    want = x + h @ w.T + b
    got = hf_decode.residual_split_k_(x, h, w, b, splits)
    assert got is x  # in place: the residual stream the layer hands on
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_groups_cover_every_row_once_in_pieces_led_by_the_prompts_row() -> None:
    """The grouped kernel's table: followers join the row they read from, groups split at the
    kernel's width, the shared length is the group's shortest (down to a block), and a bucket of
    ``b`` rows finds every group it needs among the first ``b`` entries."""
    share_row = [0, 0, 0, 3, 0, 3, 6, 0, 0]
    share_len = [0, 130, 140, 0, 150, 70, 0, 200, 129]
    groups, src, shared = kernels.attention_groups(share_row, share_len, 11, 4, 64)
    assert groups == [[0, 1, 2, 4], [7, 8], [3, 5], [6], [9], [10]]
    assert src == [0, 0, 3, 6, 9, 10]
    assert shared == [128, 128, 64, 0, 0, 0]
    assert sorted(r for g in groups for r in g) == list(range(11))
    members, src_t, shared_t = kernels.attention_group_tensors(share_row, share_len, 11, 4, 64)
    assert members.dtype == torch.int32 and members.shape == (11, 4)
    assert members[1].tolist() == [7, 8, -1, -1] and (members[6:] == -1).all()
    assert src_t.tolist()[:6] == src and shared_t.tolist()[:6] == shared
    # 64 // 8 rows of 7 query heads fill a 64-row tile; wide groups are capped
    assert [kernels.group_members_max(g) for g in (1, 6, 7, 8, 12, 16)] == [16, 8, 8, 8, 4, 4]


GROUPED_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from rlkube.runtime.rollout import kernels as K
    cpu = torch.device("cpu")
    g_ = torch.Generator().manual_seed(7)
    out = {}
    for group, d in ((7, 64), (6, 128)):
        rows, n_kv, s = 21, 2, 300
        n_heads = n_kv * group
        qkv = torch.randn(rows, (n_heads + 2 * n_kv) * d, generator=g_)
        ang = torch.arange(s)[:, None] * torch.rand(d // 2, generator=g_)[None]
        cos, ssin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([-ang.sin(), ang.sin()], -1)
        # rows 0-10 share a 150-position prompt (row 0 leads; 11 rows: pieces of 8 and 3) at
        # positions 150-249 (row 3 has nothing of its own yet); rows 11-14 a 70-position prompt;
        # rows 15-20 share nothing
        draw = [(150, 250, 11), (70, 140, 4), (0, 299, 6)]
        pos = torch.cat([torch.randint(lo, hi, (n,), generator=g_) for lo, hi, n in draw])
        pos[3] = 150
        kc, vc = torch.randn(rows, n_kv, s, d, generator=g_), torch.randn(rows, n_kv, s, d, generator=g_)
        share_row, share_len = list(range(rows)), [0] * rows
        for lead, members, plen in ((0, range(1, 11), 150), (11, range(12, 15), 70)):
            for r in members:
                kc[r, :, :plen], vc[r, :, :plen] = kc[lead, :, :plen], vc[lead, :, :plen]
                share_row[r], share_len[r] = lead, plen
        att = K.TritonDecodeAttention(rows, n_kv, group, d, s, cpu)
        att.grouped_min_rows = 1
        table = K.attention_group_tensors(share_row, share_len, rows, att.members, att.block_n)
        gk, gv = kc.clone(), vc.clone()
        for r in range(rows):  # a follower's own copy of the shared blocks: NaN, so reading it shows
            n = share_len[r] // 64 * 64
            gk[r, :, :n], gv[r, :, :n] = float("nan"), float("nan")
        # a bucket of the first 19 rows: rows 19-20 are outside it
        got = att.rope_attend(qkv[:19], cos, ssin, pos[:19], gk, gv, n_heads, groups=table)
        rk, rv = kc.clone(), vc.clone()
        want = K.rope_attention_ref(qkv[:19], cos, ssin, pos[:19], rk, rv, n_heads)
        ar = torch.arange(19)
        out[str(d)] = {
            "err": float((got - want).abs().max()),
            "k_err": float((gk[ar, :, pos[:19]] - rk[ar, :, pos[:19]]).abs().max()),
            "v_err": float((gv[ar, :, pos[:19]] - rv[ar, :, pos[:19]]).abs().max()),
            "outside_untouched": bool(torch.equal(gk[19:], kc[19:]) and torch.equal(gv[19:], vc[19:])),
        }
        for dtype in (torch.float32, torch.float16):  # the start-up self-check covers the kernel
            att = K.TritonDecodeAttention(8, n_kv, group, d, 300, cpu)
            att.grouped_min_rows = 64
            out[f"check_{d}_{dtype}"] = K.self_check(
                "attention", att, cpu, rows=8, n_kv=n_kv, group=group, d=d, seq=300, dtype=dtype)
    print(json.dumps(out))
    """
)


def test_the_grouped_attention_kernel_matches_the_reference_reading_each_prompt_from_one_row(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    """Interpreter: the grouped kernel (a group's prompt blocks once for all its rows, then each
    row's own) gives the reference's attention and cache writes with groups split in pieces,
    rows at other positions, a row with nothing of its own and a bucket smaller than the table."""
    out = triton_interpret(GROUPED_SCRIPT)
    for d in ("64", "128"):
        r = out[d]
        assert r["err"] < 1e-5 and r["k_err"] < 1e-5 and r["v_err"] < 1e-5, r
        assert r["outside_untouched"]
        assert out[f"check_{d}_torch.float32"] is None and out[f"check_{d}_torch.float16"] is None


GROUPED_ENGINE_SCRIPT = (
    SHARE_SCRIPT.replace(
        "for share in (False, True):", "for share in (False, True):  # here: grouped kernel off, on"
    )
    .replace("share_prompt_reads=share)", "grouped_attention_min_rows=int(share))")
    .replace(
        "lp_same = all(p.logprobs == q.logprobs for p, q in zip(out[False], out[True]))",
        # another tile shape, so float32 sums may round differently
        "lp_same = all(abs(x - y) < 1e-5 for p, q in zip(out[False], out[True]) "
        "for x, y in zip(p.logprobs, q.logprobs))",
    )
)


def test_the_engine_with_the_grouped_attention_kernel_decodes_the_same_samples(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    """The grouped kernel in the engine (interpreter), on the sharing test's samples: the same
    tokens and log-probabilities as one program per row, while a group's first row stops and its
    row is reused by another prompt."""
    out = triton_interpret(GROUPED_ENGINE_SCRIPT)
    assert out["kernels"]["attention"] == "triton"
    assert out["same_tokens"] and out["same_logprobs"]
    assert out["calls"] == out["calls_off"]  # the same rows shared, with the grouped kernel or not
    assert out["calls"][0] == [[0, 0, 0, 0, 4, 4], [0, 70, 70, 70, 0, 131]]


def test_a_negative_grouped_attention_min_rows_is_refused_naming_the_field(model: Any) -> None:
    with pytest.raises(ValueError, match="grouped_attention_min_rows must be an integer >= 0"):
        HFEngine(model=model, num_slots=4, max_seq_len=32, grouped_attention_min_rows=-1)
