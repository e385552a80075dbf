"""Trainer building blocks: batch layout, exact micro-batch accumulation, schedules, replay, checkpoints,
status pushes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlkube.runtime.trainer.batch import Sample, collate
from rlkube.runtime.trainer.checkpoint import list_checkpoints, load_latest, save_checkpoint
from rlkube.runtime.trainer.critic import CriticWorker
from rlkube.runtime.trainer.packing import split_to_count
from rlkube.runtime.trainer.policy import PolicyWorker
from rlkube.runtime.trainer.replay import ReplayBuffer
from rlkube.runtime.trainer.worker import LossConfig, OptimConfig, lr_lambda


def _sample(p: list[int], r: list[int], group: str = "g", version: int = 0, score: float = 0.0) -> Sample:
    return Sample(prompt_ids=p, response_ids=r, group=group, policy_version=version, score=score)


def test_collate_aligns_every_response_at_the_prompt_width() -> None:
    b = collate([_sample([1, 5, 6], [7, 2]), _sample([1, 5], [8, 9, 2], "h")], pad_id=0)
    assert b.prompt_width == 3
    assert b.input_ids.tolist() == [[1, 5, 6, 7, 2, 0], [0, 1, 5, 8, 9, 2]]
    assert b.responses.tolist() == [[7, 2, 0], [8, 9, 2]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.position_ids[1].tolist()[1:] == [0, 1, 2, 3, 4]  # left pad does not shift positions
    assert b.group_index.tolist() == [0, 1]


def _batch_with_extras(worker: PolicyWorker) -> Any:
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        p = [1, *torch.randint(4, 16, (3 + i % 2,), generator=g).tolist()]
        r = [*torch.randint(4, 16, (1 + i % 4,), generator=g).tolist(), 2]
        samples.append(_sample(p, r, f"g{i // 4}", score=float(i % 2)))
    b = collate(samples, 0)
    old, _ = worker.compute_logprobs(b)
    b.extras["old_logp"] = old
    b.extras["advantages"] = (torch.arange(8, dtype=torch.float32) - 3.5)[:, None] * b.response_mask
    return b


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_gives_the_same_update_as_one_big_batch(tiny_task: Any, agg: str) -> None:
    """Token-mean over a mini-batch must not depend on how it is cut into micro-batches."""
    params = []
    for mbs in (8, 3, 1):
        torch.manual_seed(0)
        w = PolicyWorker(
            str(tiny_task.model_dir),
            optim=OptimConfig(lr=1e-3, grad_clip=0.0),
            loss=LossConfig(agg_mode=agg),
            micro_batch_size=mbs,
        )
        w.optimizer = torch.optim.SGD(w.model.parameters(), lr=1.0)  # param change == -gradient
        b = _batch_with_extras(w)
        w.update(b, num_mini_batches=1)
        params.append(torch.cat([p.detach().flatten() for p in w.model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-5)
    assert torch.allclose(params[0], params[2], atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 14, 40])
def test_token_micro_batches_give_the_same_logprobs_and_update_as_one_big_batch(
    tiny_task: Any, tokens: int
) -> None:
    """training.microBatchTokens regroups and trims rows; log-probs come back in row order and the
    update equals one pass over the whole batch (1: every row alone; 40: several rows per pass)."""
    results = []
    for kw in ({"micro_batch_size": 8}, {"micro_batch_tokens": tokens}):
        torch.manual_seed(0)
        w = PolicyWorker(str(tiny_task.model_dir), optim=OptimConfig(lr=1e-3, grad_clip=0.0), **kw)
        w.optimizer = torch.optim.SGD(w.model.parameters(), lr=1.0)  # param change == -gradient
        b = _batch_with_extras(w)
        logp, ent = w.compute_logprobs(b, with_entropy=True)
        assert ent is not None
        plans = w.plan_micro_batches(b)
        del b.extras["old_logp"]  # on-policy: the update's own log-probs are kept, in row order
        w.update(b, num_mini_batches=1)
        kept = w.last_update_logp
        assert kept is not None
        params = torch.cat([p.detach().flatten() for p in w.model.parameters()])
        results.append((logp * b.response_mask, ent * b.response_mask, kept * b.response_mask, params, plans))
    (lp0, ent0, kept0, par0, _), (lp1, ent1, kept1, par1, plans) = results
    if tokens == 1:
        assert len(plans) == 8
    if tokens == 40:
        assert 1 < len(plans) < 8 and all(len(p.rows) * p.batch.input_ids.shape[1] <= 40 for p in plans)
    assert sorted(r for p in plans for r in p.rows) == list(range(8))
    assert torch.allclose(lp0, lp1, atol=1e-5) and torch.allclose(ent0, ent1, atol=1e-5)
    assert torch.allclose(kept0, kept1, atol=1e-5) and torch.allclose(lp0, kept1, atol=1e-5)
    assert torch.allclose(par0, par1, atol=1e-5)


def test_split_to_count_halves_the_largest_groups_then_asks_for_stand_ins() -> None:
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == ([[0, 1], [2, 3], [4]], 0)
    assert split_to_count([[0, 1, 2], [3, 4]], 4) == ([[0], [1], [2], [3, 4]], 0)
    assert split_to_count([[0], [1]], 4) == ([[0], [1]], 2)
    assert split_to_count([[0, 1]], 1) == ([[0, 1]], 0)
    with pytest.raises(ValueError):
        split_to_count([[0], [1]], 1)


def test_update_raises_the_logprob_of_positive_advantage_responses(tiny_task: Any) -> None:
    w = PolicyWorker(str(tiny_task.model_dir), optim=OptimConfig(lr=1e-3), micro_batch_size=4)
    b = _batch_with_extras(w)
    before = b.extras["old_logp"]
    for _ in range(3):
        w.update(b, num_mini_batches=2)
    after, _ = w.compute_logprobs(b)
    delta = ((after - before) * b.response_mask).sum(1)
    assert delta[-1] > 0 and delta[0] < 0  # adv +3.5 went up, adv -3.5 went down


def test_lr_schedule_warms_up_then_decays() -> None:
    f = lr_lambda(OptimConfig(warmup_steps=4, total_steps=14, schedule="cosine"))
    assert [round(f(s), 3) for s in (0, 3)] == [0.25, 1.0]
    assert f(9) == pytest.approx(0.5)
    assert f(14) == pytest.approx(0.0)
    lin = lr_lambda(OptimConfig(total_steps=10, schedule="linear"))
    assert lin(5) == pytest.approx(0.5)


def test_replay_buffer_drops_groups_past_the_threshold() -> None:
    buf = ReplayBuffer(4)
    buf.put([_sample([1], [2], "a", version=0)] * 2)
    buf.put([_sample([1], [2], "b", version=1), _sample([1], [2], "b", version=2)])
    buf.put([_sample([1], [2], "c", version=2)])
    dropped = buf.drop_stale(version=2, max_staleness=1)  # group a is 2 versions behind
    assert [g[0].group for g in dropped] == ["a"] and len(dropped[0]) == 2
    assert [g[0].group for g in buf.groups()] == ["b", "c"]
    assert [g[0].group for g in buf.drop_stale(version=3, max_staleness=1)] == ["b"]  # oldest sample counts
    assert [g[0].group for g in buf.take(1)] == ["c"] and len(buf) == 0


def test_replay_buffer_hands_out_the_oldest_policy_first() -> None:
    buf = ReplayBuffer(8)
    for name, v in (("new1", 2), ("old", 1), ("new2", 2), ("older", 0)):
        buf.put([_sample([1], [2], name, version=v)])
    assert buf.count_at_least_stale(version=2, staleness=1) == 2
    assert [g[0].group for g in buf.take(3)] == ["older", "old", "new1"]
    assert [g[0].group for g in buf.groups()] == ["new2"]


def test_checkpoints_are_atomic_and_pruned(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, {"step": step, "t": torch.ones(2) * step}, [{"x": step}], keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006", "step-000008"]
    (tmp_path / ".tmp-step-000010-1").mkdir()  # a save killed half-way is never "latest"
    (tmp_path / "step-000012").mkdir()  # nor a directory without its state file
    loaded = load_latest(tmp_path)
    assert loaded is not None
    state, replay = loaded
    assert state["step"] == 8 and replay == [{"x": 8}]


class _FakeApi:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    def patch_namespaced_custom_object_status(self, *args: Any, **kw: Any) -> None:
        self.calls.append((*args, kw))
        if self.fail:
            raise RuntimeError("403 forbidden")


def test_status_pusher_merge_patches_progress_rate_limited_and_never_raises() -> None:
    from rlkube.runtime.metrics import StatusPusher, progress_from_metrics

    api = _FakeApi()
    p = StatusPusher("job", "ns", min_interval_s=3600, api=api)
    prog = progress_from_metrics(
        3, 10, {"reward/mean": 0.5, "staleness/mean": 0.25, "perf/tokens_per_s": 9.0}
    )
    assert p.push(prog) and not p.push(prog)  # rate-limited
    assert p.push(prog, force=True)
    group, version, ns, plural, name, body, kw = api.calls[0]
    assert (group, version, ns, plural, name) == ("rlkube.io", "v1alpha1", "ns", "rljobs", "job")
    assert kw["_content_type"] == "application/merge-patch+json"
    assert set(body) == {"status"} and set(body["status"]) == {"progress"}
    got = body["status"]["progress"]
    assert got["stepDisplay"] == "3/10" and got["rewardMean"] == 0.5 and got["stalenessMean"] == 0.25
    assert got["tokensPerSecond"] == 9.0 and "lastUpdateTime" in got
    bad = StatusPusher("job", "ns", min_interval_s=0, api=_FakeApi(fail=True))
    assert bad.push(prog) is False and bad.failures == 1
    assert StatusPusher(None, None).push(prog) is False  # outside a cluster: disabled


class _ParamCasts(TorchDispatchMode):
    """Counts bf16 casts of the given parameters (autocast's weight casts), by storage."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        cast = func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
        if cast and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **kwargs)


def test_bf16_update_casts_each_weight_once_per_step_and_accumulates_every_micro_batch(
    tiny_task: Any,
) -> None:
    """With bf16 autocast (one rank) the fp32 master weights are cast once per optimiser step, not once
    per micro-batch, and the gradient still sums over every micro-batch."""
    grads, casts = [], []
    for mbs in (8, 1):
        torch.manual_seed(0)
        w = PolicyWorker(
            str(tiny_task.model_dir),
            optim=OptimConfig(lr=1e-3, grad_clip=0.0),
            micro_batch_size=mbs,
            bf16=True,
        )
        w.optimizer = torch.optim.SGD(w.model.parameters(), lr=1.0)  # param change == -gradient
        b = _batch_with_extras(w)
        before = [p.detach().clone() for p in w.model.parameters()]
        matrices = [p for p in w.model.parameters() if p.dim() == 2]
        with _ParamCasts(matrices) as counter:
            w.update(b, num_mini_batches=1)
        casts.append(counter.count)
        grads.append(
            torch.cat(
                [(p0 - p.detach()).flatten() for p0, p in zip(before, w.model.parameters(), strict=True)]
            )
        )
    assert casts[0] > 0, "autocast cast no weight: the test does not see casts"
    assert casts[1] == casts[0], f"8 micro-batches cast the weights {casts[1]} times, one batch {casts[0]}"
    # bf16 forward passes over different micro-batch shapes: equal to bf16 rounding.
    rel = (grads[0] - grads[1]).norm() / grads[0].norm()
    assert rel < 2e-2, f"micro-batched bf16 gradient differs from one batch's by {rel:.3g} (relative)"


def test_critic_token_micro_batches_give_the_same_values_and_update(tiny_task: Any) -> None:
    """The critic follows training.microBatchTokens too: same values in row order, same update."""
    out = []
    for kw in ({"micro_batch_size": 8}, {"micro_batch_tokens": 14}):
        torch.manual_seed(0)
        c = CriticWorker(str(tiny_task.model_dir), optim=OptimConfig(lr=1e-3, grad_clip=0.0), **kw)
        c.optimizer = torch.optim.SGD(c.model.parameters(), lr=1.0)  # param change == -gradient
        actor = PolicyWorker(str(tiny_task.model_dir), micro_batch_size=8)
        b = _batch_with_extras(actor)
        values = c.compute_values(b)
        b.extras["values"] = values
        b.extras["returns"] = values + b.extras["advantages"] * 0.1
        before = torch.cat([p.detach().flatten() for p in c.model.parameters()])
        c.update(b, num_mini_batches=1)
        after = torch.cat([p.detach().flatten() for p in c.model.parameters()])
        assert float((after - before).abs().max()) > 1e-4  # the update moved the critic
        out.append((values * b.response_mask, after))
    assert len(c.plan_micro_batches(b)) > 1
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    assert torch.allclose(out[0][1], out[1][1], atol=1e-5)


def test_compiled_decoder_layers_give_the_eager_update(tiny_task: Any) -> None:
    """``compile_layers`` (regional torch.compile, what the GPU bench's ``--train-compile`` turns
    on) compiles every decoder layer and changes no number a user sees: log-probs, the gradient of
    the loss and the update's loss equal the eager worker's."""
    from rlkube.runtime.trainer.policy import response_logits_window
    from rlkube.runtime.trainer.token_logprob import token_logprobs

    workers = []
    for compiled in (False, True):
        torch.manual_seed(0)
        workers.append(
            PolicyWorker(
                str(tiny_task.model_dir),
                optim=OptimConfig(lr=1e-3, grad_clip=0.0),
                micro_batch_size=8,
                device="cpu",
                compile_layers=compiled,
            )
        )
    eager, compiled_w = workers
    assert eager.compiled_layers == 0
    assert compiled_w.compiled_layers == len(compiled_w.model.model.layers) >= 2
    b = _batch_with_extras(eager)
    lp_e, _ = eager.compute_logprobs(b)
    lp_c, _ = compiled_w.compute_logprobs(b)
    assert torch.allclose(lp_c, lp_e, atol=1e-5)
    grads = []
    for w in workers:
        w.model.train()
        logits, first = response_logits_window(w.model, b)
        lp, _ = token_logprobs(logits, b.responses, first=first)
        (lp * b.extras["advantages"]).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in w.model.parameters()]))
        w.model.zero_grad(set_to_none=True)
    assert torch.allclose(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    m_e = eager.update(b, num_mini_batches=1)
    m_c = compiled_w.update(b, num_mini_batches=1)
    assert m_c["actor/pg_loss"] == pytest.approx(m_e["actor/pg_loss"], abs=1e-5)


@pytest.mark.parametrize("rows", [list(range(8)), [2, 3, 4], [5, 1, 6], [3, 3], []])
def test_select_copies_the_rows_it_names_in_their_order(rows: list[int]) -> None:
    """``Batch.select`` (a rank's shard, a mini-batch) equals indexing each column by ``rows``,
    for a consecutive run (sliced and cloned) as for any other list, and is a copy."""
    b = collate(
        [_sample([1, 2 + i], [3 + i] * (1 + i % 3), f"g{i // 4}", score=float(i)) for i in range(8)], 0
    )
    b.extras["advantages"] = torch.arange(8.0)[:, None] * b.response_mask
    idx = torch.as_tensor(rows, dtype=torch.long)
    s = b.select(rows)
    for name in (
        "input_ids",
        "attention_mask",
        "position_ids",
        "responses",
        "response_mask",
        "scores",
        "group_index",
    ):
        assert torch.equal(getattr(s, name), getattr(b, name)[idx]), name
    assert torch.equal(s.extras["advantages"], b.extras["advantages"][idx])
    before = b.input_ids.clone()
    s.input_ids.fill_(-1)
    s.extras["advantages"].fill_(-1)
    assert torch.equal(b.input_ids, before) and bool((b.extras["advantages"] >= 0).all())
