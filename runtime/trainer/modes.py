"""The three mode drivers over any engine that speaks the rollout interface (in-process or a Ray actor).

- ``SyncDriver``: generate -> reward -> old log-prob -> (ref) -> advantages -> update -> weight sync.
- ``ColocateAsyncDriver``: trainer and rollout share devices. Sampling is over-subscribed by
  ``(1 + stalenessThreshold)``; once a batch's worth of groups is complete the rest is aborted
  (tokens kept), the update runs, weights are pushed and the interrupted samples resume under the
  new weights, so no generated token is wasted.
- ``SeparateAsyncDriver``: dedicated rollout engines are kept fed by a rollouter thread that streams
  finished groups into a bounded :class:`ReplayBuffer`; the trainer pulls one mini-batch per update
  and pushes weights every ``parameterSyncStep`` updates.

``stalenessThreshold`` has verl's meaning in both async modes: per weights version the rollout
starts at most ``(1 + threshold) x trainBatchSize`` groups counting those carried over from before,
so at most a fraction ``threshold`` of each batch was started by an older policy, and no group is
trained more than ``ceil(threshold)`` versions after it started (``staleness_bound``). A straggler
that would break that bound is dropped (``stalePolicy: drop``) or waited for and trained in time
(``wait``); drops are counted (``staleness/dropped_groups_total``). DAPO dynamic sampling runs in
every mode: zero-variance groups are dropped as they complete and generation continues.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rlkube.api import RLJobSpec, effective_async
from rlkube.runtime.algos import DynamicSamplingBuffer, DynamicSamplingExhaustedError
from rlkube.runtime.errors import UserError
from rlkube.runtime.rollout.base import Completion, RolloutRequest
from rlkube.runtime.trainer.batch import Sample
from rlkube.runtime.trainer.core import PromptRef, Trainer, sample_metrics
from rlkube.runtime.trainer.replay import ReplayBuffer, group_version

log = logging.getLogger(__name__)


# Run-long counters in Trainer.totals (checkpointed; the run loop reports them every step).
DS_DROPPED = "dynamic_sampling/dropped_groups_total"
STALE_DROPPED = "staleness/dropped_groups_total"
STALE_DROPPED_SAMPLES = "staleness/dropped_samples_total"
ABORTED = "rollout/aborted_total"
RESUMED = "rollout/resumed_total"


def staleness_bound(threshold: float) -> int:
    """Versions a group may lag behind the trainer: ``ceil(threshold)`` (0 on-policy, 0.5 -> 1)."""
    return math.ceil(threshold - 1e-9)


def group_capacity(threshold: float, batch_groups: int) -> int:
    """Groups the rollout may start per weights version, carried-over ones included."""
    return max(batch_groups, math.ceil((1.0 + threshold) * batch_groups - 1e-9))


def stale_fraction(samples: Sequence[Sample], version: int) -> float:
    """Share of samples started by an older policy than the one being updated (verl's fraction)."""
    return sum(s.policy_version < version for s in samples) / max(len(samples), 1)


class GroupFilter:
    """DAPO dynamic sampling for groups that arrive one by one (the async modes).

    A group whose scores are all equal is dropped (its GRPO advantages are all zero) and the rollout
    keeps generating; a step that has dropped ``maxGenBatches x trainBatchSize`` groups gives up
    with :class:`DynamicSamplingExhaustedError`, as the sync mode does after ``maxGenBatches``
    generation batches.
    """

    def __init__(self, spec: RLJobSpec, totals: Counter[str]) -> None:
        ds = spec.algorithm.dynamic_sampling
        self.totals = totals
        self.enabled = ds is not None and ds.enabled
        self.batch = spec.training.train_batch_size
        self.limit = (ds.max_gen_batches if ds is not None else 0) * self.batch
        self.seen = 0  # groups judged this step
        self.dropped = 0  # of which dropped this step
        if self.enabled:
            totals[DS_DROPPED] += 0  # reported from the first step on

    def keep(self, group: Sequence[Sample]) -> bool:
        if not self.enabled or not group:
            return True
        self.seen += 1
        scores = [s.score for s in group]
        if max(scores) > min(scores):
            return True
        self.dropped += 1
        self.totals[DS_DROPPED] += 1
        if 0 < self.limit <= self.dropped:
            raise DynamicSamplingExhaustedError(
                f"dynamic sampling dropped {self.dropped} zero-variance groups in one step "
                f"(algorithm.dynamicSampling.maxGenBatches {self.limit // self.batch} x trainBatchSize "
                f"{self.batch}): rewards are too uniform; raise maxGenBatches or make the task "
                "harder/easier"
            )
        return False

    def step_metrics(self) -> dict[str, float]:
        """This step's counts (then reset); empty when dynamic sampling is off."""
        if not self.enabled:
            return {}
        m = {
            "dynamic_sampling/gen_batches": self.seen / self.batch,
            "dynamic_sampling/dropped_groups": float(self.dropped),
        }
        self.seen = self.dropped = 0
        return m


class _Base:
    def __init__(self, trainer: Trainer, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("at least one rollout engine")
        self.tr = trainer
        self.engines = list(engines)
        self.sync_seconds_total = 0.0

    # -- shared pieces -----------------------------------------------------------------------
    def push_weights(self, timing: dict[str, float]) -> dict[str, float]:
        """New version to every engine; nothing may be in flight (callers abort or drain first)."""
        t0 = time.perf_counter()
        version = self.tr.version + 1
        if self._direct_full_sync():
            # Same process, full sync: copy the trainer's tensors straight in (validated, grouped);
            # packing and checksumming buckets would only add passes over memory.
            params = list(self.tr.actor.full_named_parameters())
            for e in self.engines:
                e.load_weights(params, version)
            st = self.tr.direct_sync_stats([getattr(e, "last_load_stats", None) for e in self.engines])
        else:
            buckets = self.tr.weight_buckets(version)
            for e in self.engines:
                e.update_weights(buckets, version)
            st = self.tr.sync_stats()
        self.tr.version = version
        dt = time.perf_counter() - t0
        timing["update_weights"] = dt
        if dt > 0 and "weight_sync/payload_mb" in st:
            st["weight_sync/mb_per_s"] = st["weight_sync/payload_mb"] * len(self.engines) / dt
        return st

    def _direct_full_sync(self) -> bool:
        """Full sync and every engine lives in this process with ``direct_weights``."""
        return self.tr.spec.weight_sync.method == "full" and all(
            getattr(getattr(e, "capabilities", None), "direct_weights", False) for e in self.engines
        )

    def evaluate(self) -> dict[str, float]:
        """Greedy mean reward on the validation prompts (one sample each) under the served weights."""
        tr = self.tr
        if not tr.val_records:
            return {}
        refs = {f"eval{i}": PromptRef(r, -1, tr.encode(r)) for i, r in enumerate(tr.val_records)}
        reqs = [
            RolloutRequest(k, p.prompt_ids, tr.sampling_params(n=1, greedy=True)) for k, p in refs.items()
        ]
        t0 = time.perf_counter()
        comps = self._generate(reqs)
        samples = tr.score(comps, refs)
        n = max(len(samples), 1)
        return {
            "eval/reward_mean": sum(s.reward for s in samples) / n,
            "eval/accuracy": sum(s.accuracy for s in samples) / n,
            "timing_s/eval": time.perf_counter() - t0,
        }

    def _generate(self, reqs: Sequence[RolloutRequest]) -> list[Completion]:
        """Spread requests over the engines and wait for all of them."""
        if len(self.engines) == 1:
            return list(self.engines[0].generate(list(reqs)))
        shards: list[list[RolloutRequest]] = [[] for _ in self.engines]
        for i, r in enumerate(reqs):
            shards[i % len(self.engines)].append(r)
        out: list[Completion] = []
        for e, s in zip(self.engines, shards, strict=True):
            if s:
                out.extend(e.generate(s))
        return out

    def replay_state(self) -> list[dict[str, Any]]:
        return []

    def load_replay(self, samples: list[dict[str, Any]]) -> None:
        return None

    def after_resume(self) -> None:
        """Bring the engines to the trainer's weights (a fresh engine starts from spec.model.path)."""
        if self.tr.step > 0 or self.tr.version > 0:
            self.tr.version -= 1  # push_weights bumps it back to the checkpoint's version
            self.push_weights({})

    def close(self) -> None:
        return None

    def _finish(
        self, samples: list[Sample], timing: dict[str, float], extra: dict[str, float]
    ) -> dict[str, float]:
        m = sample_metrics(samples, self.tr.version)
        m.update(extra)
        for k, v in timing.items():
            m[f"timing_s/{k}"] = v
        return m


class SyncDriver(_Base):
    """Generate a batch, train on it, push weights: rollout and training take turns."""

    def _collect(self, timing: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        tr, spec = self.tr, self.tr.spec
        b = spec.training.train_batch_size
        ds = spec.algorithm.dynamic_sampling
        t_gen = t_rew = 0.0
        extra: dict[str, float] = {}
        if ds is None or not ds.enabled:
            prompts = tr.next_prompts(b)
            t0 = time.perf_counter()
            comps = self._generate(tr.requests(prompts))
            t_gen = time.perf_counter() - t0
            t0 = time.perf_counter()
            samples = tr.score(comps, {f"p{p.index}": p for p in prompts})
            t_rew = time.perf_counter() - t0
        else:
            import torch

            buf: DynamicSamplingBuffer[Sample] = DynamicSamplingBuffer(b, ds.max_gen_batches)
            tr.totals[DS_DROPPED] += 0
            full = False
            while not full:
                prompts = tr.next_prompts(b)
                t0 = time.perf_counter()
                comps = self._generate(tr.requests(prompts))
                t_gen += time.perf_counter() - t0
                t0 = time.perf_counter()
                got = tr.score(comps, {f"p{p.index}": p for p in prompts})
                t_rew += time.perf_counter() - t0
                gids = {g: i for i, g in enumerate(dict.fromkeys(s.group for s in got))}
                full = buf.add(
                    got, torch.tensor([s.score for s in got]), torch.tensor([gids[s.group] for s in got])
                )
                extra["dynamic_sampling/gen_batches"] = float(buf.num_gen_batches)
                extra["dynamic_sampling/dropped_groups"] = float(buf.num_dropped_groups)
            tr.totals[DS_DROPPED] += buf.num_dropped_groups
            samples = [s for g in buf.take() for s in g]
        if not samples:
            raise UserError(
                "every sample of the batch had a non-finite reward (data.nonFiniteReward: skip): "
                f"check the reward function {spec.data.reward!r}"
            )
        timing["gen"] = t_gen
        timing["reward"] = t_rew
        return samples, extra

    def step(self) -> dict[str, float]:
        t_step = time.perf_counter()
        timing: dict[str, float] = {}
        samples, extra = self._collect(timing)
        version_used = self.tr.version
        m = self.tr.train(samples, timing)
        extra.update(m)
        m = self._finish(samples, timing, extra)
        m["staleness/mean"] = float(sum(version_used - s.policy_version for s in samples) / len(samples))
        m.update(self.push_weights(timing))
        m["timing_s/update_weights"] = timing["update_weights"]
        step_s = time.perf_counter() - t_step
        m["timing_s/step"] = step_s
        m["perf/trainer_idle_ratio"] = timing["gen"] / step_s
        m["perf/rollout_idle_ratio"] = 1.0 - timing["gen"] / step_s
        return m


class ColocateAsyncDriver(_Base):
    """Shared devices, one-step-off with partial rollout (abort at end of sampling, resume after sync)."""

    def __init__(self, trainer: Trainer, engines: Sequence[Any]) -> None:
        super().__init__(trainer, engines)
        a = effective_async(trainer.spec)
        b = trainer.spec.training.train_batch_size
        self.oversub = group_capacity(a.staleness_threshold, b)
        self.partial_rollout = a.partial_rollout
        self.threshold = a.staleness_threshold
        self.max_stale = staleness_bound(a.staleness_threshold)
        self.filter = GroupFilter(trainer.spec, trainer.totals)
        trainer.totals[STALE_DROPPED] += 0  # reported from the first step on
        self.refs: dict[str, PromptRef] = {}
        self.started: dict[str, int] = {}  # request id -> weights version that started it
        self.done: dict[str, list[Completion]] = {}
        self.partials: list[Completion] = []
        self.carried: list[Sample] = []  # complete groups finished after the batch filled (next step)

    def _top_up(self, engine: Any, ready_groups: int) -> None:
        """Start groups until in-flight + ready-to-train groups fill this version's budget."""
        want = self.oversub - len(self.refs) - ready_groups
        if want > 0:
            prompts = self.tr.next_prompts(want)
            for p in prompts:
                self.refs[f"p{p.index}"] = p
                self.started[f"p{p.index}"] = self.tr.version
            engine.submit(self.tr.requests(prompts))

    def _forget(self, rid: str) -> None:
        self.refs.pop(rid, None)
        self.started.pop(rid, None)
        self.done.pop(rid, None)

    def step(self) -> dict[str, float]:
        tr = self.tr
        b = tr.spec.training.train_batch_size
        n = tr.spec.algorithm.group_size
        eng = self.engines[0]
        timing: dict[str, float] = {}
        t_step = time.perf_counter()
        t0 = time.perf_counter()
        # Groups started too long ago cannot be trained on any more: drop them instead of finishing.
        too_old = {
            c.request_id for c in self.partials if tr.version - self.started[c.request_id] > self.max_stale
        }
        too_old |= {s.group for s in self.carried if tr.version - s.policy_version > self.max_stale}
        for rid in too_old:
            self._forget(rid)
        tr.totals[STALE_DROPPED] += len(too_old)
        self.partials = [c for c in self.partials if c.request_id not in too_old]
        if self.partials:
            eng.resume(self.partials)
            self.partials = []
        ready: list[Sample] = [s for s in self.carried if s.group not in too_old]
        self.carried = []
        ready_groups = len({s.group for s in ready})
        self._top_up(eng, ready_groups)
        t_rew = 0.0
        while ready_groups < b:
            got = eng.poll()
            if not got:
                time.sleep(0.01)
                continue
            for c in got:
                self.done.setdefault(c.request_id, []).append(c)
            for rid in [r for r, cs in self.done.items() if len(cs) >= n]:
                cs = self.done.pop(rid)
                if tr.version - self.started[rid] > self.max_stale:
                    self._forget(rid)
                    tr.totals[STALE_DROPPED] += 1
                    continue
                t1 = time.perf_counter()
                group = tr.score(cs, self.refs)
                t_rew += time.perf_counter() - t1
                self._forget(rid)
                if group and self.filter.keep(group):
                    ready.extend(group)
                    ready_groups += 1
            self._top_up(eng, ready_groups)  # dropped groups (dynamic sampling, NaN rewards) are replaced
        # End of sampling: abort the rest, keep their tokens for after the update.
        aborted = eng.abort_all()
        timing["gen"] = time.perf_counter() - t0 - t_rew
        timing["reward"] = t_rew
        # Train the groups started by the oldest policy first; the rest carry over.
        by_group: dict[str, list[Sample]] = {}
        for smp in ready:
            by_group.setdefault(smp.group, []).append(smp)
        order = sorted(by_group, key=lambda g: group_version(by_group[g]))
        batch = [smp for g in order[:b] for smp in by_group[g]]
        self.carried = [smp for g in order[b:] for smp in by_group[g]]
        finished = [c for c in aborted if c.finish_reason != "abort"]
        for c in finished:
            self.done.setdefault(c.request_id, []).append(c)
        partial = [c for c in aborted if c.finish_reason == "abort"]
        if self.partial_rollout:
            self.partials = partial
        else:  # no partial rollout: drop the unfinished requests entirely
            for rid in {c.request_id for c in partial}:
                self._forget(rid)
        version_used = tr.version
        m_train = tr.train(batch, timing)
        m = self._finish(batch, timing, m_train)
        m["staleness/mean"] = sum(version_used - s.policy_version for s in batch) / len(batch)
        m["staleness/max"] = float(max(version_used - s.policy_version for s in batch))
        m["staleness/stale_fraction"] = stale_fraction(batch, version_used)
        m["staleness/threshold"] = self.threshold
        m["rollout/aborted_samples"] = float(len(partial))
        m.update(self.filter.step_metrics())
        m.update(self.push_weights(timing))
        m["timing_s/update_weights"] = timing["update_weights"]
        step_s = time.perf_counter() - t_step
        m["timing_s/step"] = step_s
        m["perf/trainer_idle_ratio"] = timing["gen"] / step_s
        m["perf/rollout_idle_ratio"] = 1.0 - timing["gen"] / step_s
        return m

    def close(self) -> None:
        for e in self.engines:
            try:
                e.abort_all()
            except Exception as exc:
                log.debug("abort at close: %s", exc)


class SeparateAsyncDriver(_Base):
    """Dedicated rollout engines stream groups into a bounded replay buffer; the trainer pulls.

    Admission (verl's ``staleness_threshold``): the rollouter starts a group only while groups in
    flight + groups buffered + groups trained in this weights version < ``(1 + threshold) x
    trainBatchSize``, so at a weight sync at most ``threshold x trainBatchSize`` groups carry over.
    The trainer takes the oldest-started groups first. With ``stalePolicy: wait`` a pull waits for
    in-flight groups that must be trained in this version to stay within ``ceil(threshold)``; with
    ``drop`` such stragglers are dropped (at the sync if still generating, else at the next pull).
    """

    def __init__(self, trainer: Trainer, engines: Sequence[Any], poll_interval_s: float = 0.02) -> None:
        super().__init__(trainer, engines)
        spec = trainer.spec
        a = effective_async(spec)
        self.a = a
        self.mini = spec.training.mini_batch_size
        self.sync_every = a.parameter_sync_step
        self.b = spec.training.train_batch_size
        self.threshold = a.staleness_threshold
        self.max_stale = staleness_bound(a.staleness_threshold)
        self.buffer = ReplayBuffer(max(self.mini, group_capacity(a.staleness_threshold, self.b)))
        self.filter = GroupFilter(spec, trainer.totals)
        self.poll_interval_s = poll_interval_s
        self.refs: dict[str, PromptRef] = {}
        self.started: dict[str, int] = {}  # request id -> weights version that started it
        self.done: dict[str, list[Completion]] = {}
        self.consumed_in_version = 0
        self.lock = threading.Condition()
        self.paused = False
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.totals = trainer.totals
        for key in (STALE_DROPPED, STALE_DROPPED_SAMPLES, ABORTED, RESUMED):
            self.totals[key] += 0  # reported from the first step on

    # -- rollouter ---------------------------------------------------------------------------
    def _may_issue(self) -> bool:
        outstanding = len(self.refs) + len(self.buffer)
        return outstanding + self.consumed_in_version < self.buffer.capacity

    def _forget(self, rid: str) -> None:
        self.refs.pop(rid, None)
        self.started.pop(rid, None)
        self.done.pop(rid, None)

    def _rollouter(self) -> None:
        tr = self.tr
        n = tr.spec.algorithm.group_size
        try:
            while not self._stop.is_set():
                with self.lock:
                    while self.paused and not self._stop.is_set():
                        self.lock.wait(0.1)
                    if self._stop.is_set():
                        return
                    while self._may_issue():
                        (p,) = tr.next_prompts(1)
                        rid = f"p{p.index}"
                        self.refs[rid] = p
                        self.started[rid] = tr.version
                        self.engines[p.index % len(self.engines)].submit(tr.requests([p]))
                    got: list[Completion] = []
                    for e in self.engines:
                        got.extend(e.poll())
                    for c in got:
                        self.done.setdefault(c.request_id, []).append(c)
                    for rid in [r for r, cs in self.done.items() if len(cs) >= n]:
                        cs = self.done.pop(rid)
                        group = tr.score(cs, self.refs)
                        self._forget(rid)
                        if self.filter.keep(group):
                            self.buffer.put(group)
                    self.lock.notify_all()
                time.sleep(self.poll_interval_s)
        except BaseException as exc:
            self._error = exc
            with self.lock:
                self.lock.notify_all()

    def after_resume(self) -> None:
        super().after_resume()
        self._thread = threading.Thread(target=self._rollouter, name="rlkube-rollouter", daemon=True)
        self._thread.start()

    # -- trainer side ------------------------------------------------------------------------
    def _must_wait_for_stragglers(self) -> bool:
        """``wait``: taking a mini-batch now would leave no room in this version for in-flight
        groups that are already ``ceil(threshold)`` versions old (they could never be trained)."""
        v = self.tr.version
        late = sum(1 for rid in self.refs if v - self.started[rid] >= self.max_stale)
        if late == 0:
            return False
        room_after = self.b - self.consumed_in_version - self.mini
        late_buffered_left = max(0, self.buffer.count_at_least_stale(v, self.max_stale) - self.mini)
        return late + late_buffered_left > room_after

    def _pull_mini(self, timing: dict[str, float]) -> list[Sample]:
        """``miniBatchSize`` groups from the buffer, oldest-started first; stale ones are dropped."""
        t0 = time.perf_counter()
        with self.lock:
            while True:
                if self._error is not None:
                    raise self._error
                for g in self.buffer.drop_stale(self.tr.version, self.max_stale):
                    self.totals[STALE_DROPPED] += 1
                    self.totals[STALE_DROPPED_SAMPLES] += len(g)
                if self.buffer.num_groups() >= self.mini and not (
                    self.a.stale_policy == "wait" and self._must_wait_for_stragglers()
                ):
                    groups = self.buffer.take(self.mini)
                    self.consumed_in_version += len(groups)
                    break
                self.lock.wait(0.1)
        timing["wait"] = timing.get("wait", 0.0) + time.perf_counter() - t0
        return [s for g in groups for s in g]

    def _sync(self, timing: dict[str, float]) -> dict[str, float]:
        """Pause the rollouter, abort (keep or drop partials), push weights, resume."""
        with self.lock:
            self.paused = True
            partials: dict[int, list[Completion]] = {}
            for k, e in enumerate(self.engines):
                for c in e.abort_all():
                    if c.finish_reason == "abort":
                        partials.setdefault(k, []).append(c)
                    else:
                        self.done.setdefault(c.request_id, []).append(c)
            m = self.push_weights(timing)
            v = self.tr.version  # the new version
            n_partial = sum(len(v) for v in partials.values())
            self.totals[ABORTED] += n_partial
            # In-flight groups the new version makes too old can never be trained: stop them now.
            too_old = {rid for rid, s in self.started.items() if v - s > self.max_stale}
            for rid in too_old:
                self.totals[STALE_DROPPED] += 1
                self.totals[STALE_DROPPED_SAMPLES] += self.tr.spec.algorithm.group_size
                self._forget(rid)
            for k, cs in partials.items():
                keep = [c for c in cs if c.request_id not in too_old]
                if self.a.partial_rollout:
                    if keep:
                        self.engines[k].resume(keep)
                    self.totals[RESUMED] += len(keep)
                else:
                    for c in keep:
                        self._forget(c.request_id)
            self.consumed_in_version = 0
            self.paused = False
            self.lock.notify_all()
        return m

    def step(self) -> dict[str, float]:
        tr = self.tr
        t_step = time.perf_counter()
        timing: dict[str, float] = {"wait": 0.0}
        used: list[Sample] = []
        metrics: dict[str, float] = {}
        stale: list[int] = []
        for i in range(self.sync_every):
            mini = self._pull_mini(timing)
            stale.extend(tr.version - s.policy_version for s in mini)
            used.extend(mini)
            mt = tr.train(mini, timing, step_lr=i == self.sync_every - 1)
            for k, v in mt.items():
                metrics[k] = metrics.get(k, 0.0) + v / self.sync_every
        m = self._finish(used, timing, metrics)
        m["staleness/mean"] = sum(stale) / len(stale)
        m["staleness/max"] = float(max(stale))
        m["staleness/stale_fraction"] = stale_fraction(used, tr.version)
        with self.lock:
            m.update(self.filter.step_metrics())
        m.update(self._sync(timing))
        m["timing_s/update_weights"] = timing["update_weights"]
        m["timing_s/wait_rollout"] = timing["wait"]
        step_s = time.perf_counter() - t_step
        m["timing_s/step"] = step_s
        m["perf/trainer_idle_ratio"] = timing["wait"] / step_s
        m["replay/size_groups"] = float(self.buffer.num_groups())
        m["replay/capacity_groups"] = float(self.buffer.capacity)
        m["staleness/threshold"] = self.threshold
        return m

    def replay_state(self) -> list[dict[str, Any]]:
        with self.lock:
            return [s.to_dict() for g in self.buffer.groups() for s in g]

    def load_replay(self, samples: list[dict[str, Any]]) -> None:
        by: dict[str, list[Sample]] = {}
        for d in samples:
            s = Sample.from_dict(d)
            by.setdefault(s.group, []).append(s)
        for g in by.values():
            self.buffer.put(g)

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            self.lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for e in self.engines:
            try:
                e.abort_all()
            except Exception as exc:
                log.debug("abort at close: %s", exc)
