"""The three mode drivers over any engine that speaks the rollout interface (in-process or a Ray actor).

- ``SyncDriver``: generate -> reward -> old log-prob -> (ref) -> advantages -> update -> weight sync.
- ``ColocateAsyncDriver``: trainer and rollout share devices. Sampling is over-subscribed; once a
  batch's worth of groups is complete the rest is aborted (tokens kept), the update runs, weights are
  pushed and the interrupted samples resume under the new weights, so no generated token is wasted.
- ``SeparateAsyncDriver``: dedicated rollout engines are kept fed by a rollouter thread that streams
  finished groups into a bounded :class:`ReplayBuffer`; the trainer pulls one mini-batch per update
  and pushes weights every ``parameterSyncStep`` updates. Every sample carries the policy version
  that started it; samples staler than ``stalenessThreshold`` are dropped, or (``stalePolicy: wait``)
  the rollouter is throttled so they are not produced and the trainer waits for fresh ones.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

from rlkube.api import effective_async
from rlkube.runtime.algos import DynamicSamplingBuffer
from rlkube.runtime.rollout.base import Completion, RolloutRequest
from rlkube.runtime.trainer.batch import Sample
from rlkube.runtime.trainer.core import PromptRef, Trainer, sample_metrics
from rlkube.runtime.trainer.replay import ReplayBuffer

log = logging.getLogger(__name__)


def _groups(completions: Sequence[Completion]) -> dict[str, list[Completion]]:
    out: dict[str, list[Completion]] = {}
    for c in completions:
        out.setdefault(c.request_id, []).append(c)
    return out


class _Base:
    def __init__(self, trainer: Trainer, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("at least one rollout engine")
        self.tr = trainer
        self.engines = list(engines)
        self.sync_seconds_total = 0.0

    # -- shared pieces -----------------------------------------------------------------------
    def push_weights(self, timing: dict[str, float]) -> dict[str, Any]:
        """New version to every engine; nothing may be in flight (callers abort or drain first).

        The transport (direct copy, collective, IPC or object store) is chosen by
        ``rlkube.runtime.distributed.weight_sync`` and named in ``weight_sync/transport``.
        """
        from rlkube.runtime.distributed.weight_sync import push_weights

        t0 = time.perf_counter()
        version = self.tr.version + 1
        st = push_weights(self.tr, self.engines, version)
        self.tr.version = version
        timing["update_weights"] = time.perf_counter() - t0
        return st

    def _release_memory(self) -> dict[str, float]:
        """Colocated: engines free their KV cache while the trainer steps, where they can."""
        slept = [e.release_memory() for e in self.engines if hasattr(e, "release_memory")]
        return {"rollout/slept_during_update": float(bool(slept) and all(slept))}

    def _reclaim_memory(self) -> None:
        for e in self.engines:
            if hasattr(e, "reclaim_memory"):
                e.reclaim_memory()

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
        for e in self.engines:  # engine pools: how many engines, and the requests each one got
            if hasattr(e, "load_metrics"):
                m.update(e.load_metrics())
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
            samples = [s for g in buf.take() for s in g]
        timing["gen"] = t_gen
        timing["reward"] = t_rew
        return samples, extra

    def step(self) -> dict[str, float]:
        t_step = time.perf_counter()
        timing: dict[str, float] = {}
        samples, extra = self._collect(timing)
        version_used = self.tr.version
        extra.update(self._release_memory())
        m = self.tr.train(samples, timing)
        self._reclaim_memory()
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
        self.oversub = max(
            1, math.ceil(trainer.spec.training.train_batch_size * (1.0 + a.staleness_threshold))
        )
        self.partial_rollout = a.partial_rollout
        self.threshold = a.staleness_threshold
        self.max_stale = math.floor(a.staleness_threshold + 1e-9)
        self.dropped_stale = 0
        self.refs: dict[str, PromptRef] = {}
        self.done: dict[str, list[Completion]] = {}
        self.partials: list[Completion] = []
        self.carried: list[Sample] = []  # complete groups finished after the batch filled (next step)

    def _top_up(self, engine: Any) -> None:
        want = self.oversub - len(self.refs)
        if want > 0:
            prompts = self.tr.next_prompts(want)
            for p in prompts:
                self.refs[f"p{p.index}"] = p
            engine.submit(self.tr.requests(prompts))

    def step(self) -> dict[str, float]:
        tr = self.tr
        b = tr.spec.training.train_batch_size
        n = tr.spec.algorithm.group_size
        eng = self.engines[0]
        timing: dict[str, float] = {}
        t_step = time.perf_counter()
        t0 = time.perf_counter()
        # Requests started too long ago cannot be trained on any more: drop them instead of finishing.
        too_old = {c.request_id for c in self.partials if tr.version - c.policy_version > self.max_stale}
        too_old |= {s.group for s in self.carried if tr.version - s.policy_version > self.max_stale}
        for rid in too_old:
            self.refs.pop(rid, None)
            self.done.pop(rid, None)
        self.dropped_stale += len(too_old)
        self.partials = [c for c in self.partials if c.request_id not in too_old]
        if self.partials:
            eng.resume(self.partials)
            self.partials = []
        self._top_up(eng)
        ready: list[Sample] = [s for s in self.carried if s.group not in too_old]
        self.carried = []
        ready_groups = len({s.group for s in ready})
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
                if tr.version - min(c.policy_version for c in cs) > self.max_stale:
                    self.refs.pop(rid, None)
                    self.dropped_stale += 1
                    continue
                t1 = time.perf_counter()
                ready.extend(tr.score(cs, self.refs))
                t_rew += time.perf_counter() - t1
                self.refs.pop(rid, None)
                ready_groups += 1
        # End of sampling: abort the rest, keep their tokens for after the update.
        aborted = eng.abort_all()
        timing["gen"] = time.perf_counter() - t0 - t_rew
        timing["reward"] = t_rew
        groups = list(dict.fromkeys(s.group for s in ready))
        use, spill = set(groups[:b]), set(groups[b:])
        batch = [s for s in ready if s.group in use]
        self.carried = [s for s in ready if s.group in spill]
        finished = [c for c in aborted if c.finish_reason != "abort"]
        for c in finished:
            self.done.setdefault(c.request_id, []).append(c)
        partial = [c for c in aborted if c.finish_reason == "abort"]
        if self.partial_rollout:
            self.partials = partial
        else:  # no partial rollout: drop the unfinished requests entirely
            dropped = {c.request_id for c in partial}
            for rid in dropped:
                self.refs.pop(rid, None)
                self.done.pop(rid, None)
        version_used = tr.version
        slept = self._release_memory()
        m_train = tr.train(batch, timing)
        self._reclaim_memory()
        m_train.update(slept)
        m = self._finish(batch, timing, m_train)
        m["staleness/mean"] = sum(version_used - s.policy_version for s in batch) / len(batch)
        m["staleness/max"] = float(max(version_used - s.policy_version for s in batch))
        m["rollout/aborted_samples"] = float(len(partial))
        m["staleness/dropped_groups_total"] = float(self.dropped_stale)
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
    """Dedicated rollout engines stream groups into a bounded replay buffer; the trainer pulls."""

    def __init__(self, trainer: Trainer, engines: Sequence[Any], poll_interval_s: float = 0.02) -> None:
        super().__init__(trainer, engines)
        spec = trainer.spec
        a = effective_async(spec)
        self.a = a
        self.mini = spec.training.mini_batch_size
        self.sync_every = a.parameter_sync_step
        self.b = spec.training.train_batch_size
        self.threshold = a.staleness_threshold
        self.max_stale = math.floor(a.staleness_threshold + 1e-9)
        capacity = max(self.mini, math.ceil((1.0 + a.staleness_threshold) * self.b))
        self.buffer = ReplayBuffer(capacity)
        self.poll_interval_s = poll_interval_s
        self.updates_since_sync = 0
        self.refs: dict[str, PromptRef] = {}
        self.owner: dict[str, int] = {}  # request id -> engine index
        self.done: dict[str, list[Completion]] = {}
        self.issued_in_version = 0
        self.consumed_in_version = 0
        self.lock = threading.Condition()
        self.paused = False
        self._idle = 0.0
        self._busy_since = time.perf_counter()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.stats = {"dropped_stale": 0, "aborted": 0, "resumed": 0}

    # -- rollouter ---------------------------------------------------------------------------
    def _may_issue(self) -> bool:
        outstanding = len(self.refs) + len(self.buffer)
        if outstanding >= self.buffer.capacity:
            return False
        if self.a.stale_policy == "wait":
            # A group issued now is consumed about (outstanding + consumed this version) / batch
            # versions later: issue only what will be trained on within the threshold.
            return outstanding + self.consumed_in_version < (self.max_stale + 1) * self.b
        return True

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
                        k = p.index % len(self.engines)
                        self.owner[rid] = k
                        self.engines[k].submit(tr.requests([p]))
                        self.issued_in_version += 1
                    got: list[Completion] = []
                    for e in self.engines:
                        got.extend(e.poll())
                    for c in got:
                        self.done.setdefault(c.request_id, []).append(c)
                    for rid in [r for r, cs in self.done.items() if len(cs) >= n]:
                        cs = self.done.pop(rid)
                        samples = tr.score(cs, self.refs)
                        self.refs.pop(rid, None)
                        self.owner.pop(rid, None)
                        self.buffer.put(samples)
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
    def _pull_mini(self, timing: dict[str, float]) -> list[Sample]:
        """``miniBatchSize`` fresh groups from the buffer; stale ones are dropped."""
        t0 = time.perf_counter()
        with self.lock:
            while True:
                if self._error is not None:
                    raise RuntimeError("rollouter failed") from self._error
                dropped = self.buffer.drop_stale(self.tr.version, self.max_stale)
                self.stats["dropped_stale"] += dropped
                if self.buffer.num_groups() >= self.mini:
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
            n_partial = sum(len(v) for v in partials.values())
            self.stats["aborted"] += n_partial
            if self.a.partial_rollout:
                for k, cs in partials.items():
                    self.engines[k].resume(cs)
                self.stats["resumed"] += n_partial
            else:
                for cs in partials.values():
                    for c in cs:
                        self.refs.pop(c.request_id, None)
                        self.owner.pop(c.request_id, None)
                        self.done.pop(c.request_id, None)
            self.issued_in_version = 0
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
        m.update(self._sync(timing))
        m["timing_s/update_weights"] = timing["update_weights"]
        m["timing_s/wait_rollout"] = timing["wait"]
        step_s = time.perf_counter() - t_step
        m["timing_s/step"] = step_s
        m["perf/trainer_idle_ratio"] = timing["wait"] / step_s
        m["staleness/dropped_total"] = float(self.stats["dropped_stale"])
        m["rollout/aborted_total"] = float(self.stats["aborted"])
        m["rollout/resumed_total"] = float(self.stats["resumed"])
        m["replay/size_groups"] = float(self.buffer.num_groups())
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
