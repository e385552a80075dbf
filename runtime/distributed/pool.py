"""Data-parallel rollout: N engines behind the one rollout interface, balanced by load.

The mode drivers see one engine. Every request is a whole prompt group (one prompt, ``n``
samples), so a group never straddles engines (its samples share a prefix cache and come back
together); each goes to the engine with the fewest samples outstanding (ties: the one that has
been given the fewest requests, then engine order). Partial samples aborted for a weight sync
resume on whichever engine is least loaded then, since every engine holds the same weights after
the sync. Engines are local (same process) or :class:`~rlkube.runtime.distributed.remote.RemoteEngine`
(Ray actors): remote calls to all engines are started together and then awaited, so N engines
work in parallel; a dead engine raises ``EngineFailed`` naming it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rlkube.runtime.rollout.base import Completion, EngineCapabilities, RolloutRequest, in_request_order


class EnginePool:
    """Engines as one (see the module docstring); ``names`` label them in errors and metrics."""

    def __init__(
        self, engines: Sequence[Any], names: Sequence[str] | None = None, poll_s: float = 0.01
    ) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)
        self.names = list(names) if names is not None else [f"engine-{i}" for i in range(len(engines))]
        self.poll_s = poll_s
        self.outstanding = [0] * len(self.engines)  # samples submitted and not returned
        self.requests_total = [0] * len(self.engines)
        self.requests_window = [0] * len(self.engines)  # since the last load_metrics()
        self._stash: list[Completion] = []  # polled while a generate() waited for other ids
        self.collective_ready = False  # every engine joined the job's weight groups
        self.sleeping = False

    # -- fan-out -----------------------------------------------------------------------------
    def _fan(self, method: str, args: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """``method`` on every engine (per-engine ``args``), remote ones in parallel."""
        per = args if args is not None else [()] * len(self.engines)
        return self._subset(method, dict(enumerate(per)))

    def start_all(self, method: str, args: Sequence[tuple[Any, ...]] | None = None) -> list[Any]:
        """Start ``method`` on every (remote) engine without waiting; :meth:`wait_all` collects."""
        per = args if args is not None else [()] * len(self.engines)
        return [e.start(method, *a) for e, a in zip(self.engines, per, strict=True)]

    def wait_all(self, refs: Sequence[Any]) -> list[Any]:
        return [e.wait(r) for e, r in zip(self.engines, refs, strict=True)]

    @property
    def remote(self) -> bool:
        return all(hasattr(e, "start") for e in self.engines)

    # -- the rollout interface ---------------------------------------------------------------
    @property
    def capabilities(self) -> EngineCapabilities:
        caps = [e.capabilities for e in self.engines]
        first = caps[0]
        return dataclasses.replace(
            first,
            sleep=all(c.sleep for c in caps),
            abort_resume=all(c.abort_resume for c in caps),
            async_submit=all(c.async_submit for c in caps),
            delta_weights=all(c.delta_weights for c in caps),
            distributed_weights=all(c.distributed_weights for c in caps),
            direct_weights=all(c.direct_weights for c in caps),
            notes=f"{len(caps)} x {first.engine}" + (f"; {first.notes}" if first.notes else ""),
        )

    @property
    def policy_version(self) -> int:
        return int(self.engines[0].policy_version)

    @property
    def last_load_stats(self) -> Any:
        """The first engine's statistics of its last direct load (in-process engines)."""
        return getattr(self.engines[0], "last_load_stats", None)

    @property
    def weight_workers(self) -> int:
        return sum(int(e.weight_workers) for e in self.engines)

    def _least_loaded(self) -> int:
        return min(range(len(self.engines)), key=lambda i: (self.outstanding[i], self.requests_total[i], i))

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        per: list[list[RolloutRequest]] = [[] for _ in self.engines]
        for r in requests:
            k = self._least_loaded()
            per[k].append(r)
            self.outstanding[k] += r.params.n
            self.requests_total[k] += 1
            self.requests_window[k] += 1
        busy = [k for k, rs in enumerate(per) if rs]
        self._subset("submit", {k: (per[k],) for k in busy})

    def resume(self, partials: Sequence[Completion]) -> None:
        per: list[list[Completion]] = [[] for _ in self.engines]
        for c in partials:
            k = self._least_loaded()
            per[k].append(c)
            self.outstanding[k] += 1
        self._subset("resume", {k: (cs,) for k, cs in enumerate(per) if cs})

    def _subset(self, method: str, calls: dict[int, tuple[Any, ...]]) -> list[Any]:
        started = {}
        for k, a in calls.items():
            e = self.engines[k]
            started[k] = (
                ("ref", e.start(method, *a)) if hasattr(e, "start") else ("value", getattr(e, method)(*a))
            )
        return [self.engines[k].wait(v) if kind == "ref" else v for k, (kind, v) in started.items()]

    def poll(self) -> list[Completion]:
        out, self._stash = self._stash, []
        for k, got in enumerate(self._fan("poll")):
            self.outstanding[k] = max(self.outstanding[k] - len(got), 0)
            out.extend(got)
        return out

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        """Blocking: spread the groups, wait for all their samples, return them in request order."""
        if len(self.engines) == 1:  # nothing to balance: one blocking call, no polling
            self.requests_total[0] += len(requests)
            self.requests_window[0] += len(requests)
            return list(self.engines[0].generate(list(requests)))
        ids = {r.request_id for r in requests}
        want = sum(r.params.n for r in requests)
        self.submit(requests)
        mine: list[Completion] = []
        while True:
            other: list[Completion] = []
            for c in self.poll():
                (mine if c.request_id in ids else other).append(c)
            self._stash.extend(other)
            if len(mine) >= want:
                break
            time.sleep(self.poll_s)
        return in_request_order(mine, requests)

    def num_in_flight(self) -> int:
        return sum(int(n) for n in self._fan("num_in_flight"))

    def abort_all(self) -> list[Completion]:
        out: list[Completion] = []
        for got in self._fan("abort_all"):
            out.extend(got)
        self.outstanding = [0] * len(self.engines)
        return out

    def release_memory(self) -> bool:
        """Colocated modes, while the trainer steps: every engine frees its KV cache (sleep level 1)
        where it can (``capabilities.sleep``: vLLM on GPUs); False, and nothing done, elsewhere."""
        if self.sleeping or not self.capabilities.sleep:
            return False
        self._fan("sleep", [(1,)] * len(self.engines))
        self.sleeping = True
        return True

    def reclaim_memory(self) -> None:
        """Wake the engines again (before weights are pushed and generation resumes)."""
        if self.sleeping:
            self._fan("wake")
            self.sleeping = False

    def sleep(self, level: int = 1) -> None:
        self._fan("sleep", [(level,)] * len(self.engines))

    def wake(self) -> None:
        self._fan("wake")

    def load_weights(self, named_tensors: Iterable[Any], version: int) -> None:
        items = list(named_tensors)
        self._fan("load_weights", [(items, version)] * len(self.engines))

    def update_weights(self, buckets: Iterable[Any], version: int) -> set[str]:
        items = list(buckets)
        changed: set[str] = set()
        for c in self._fan("update_weights", [(items, version)] * len(self.engines)):
            changed |= set(c)
        return changed

    def join_weight_groups(self, specs: list[Any], rank: int) -> None:
        self.finish_join(self.start_join(specs, rank))

    def finish_join(self, refs: Sequence[Any]) -> None:
        self.wait_all(refs)
        self.collective_ready = True

    def start_join(self, specs: list[Any], rank: int) -> list[Any]:
        """Every engine joins the weight groups, its workers numbered on from ``rank`` (no wait:
        the trainer ranks join at the same time)."""
        firsts, nxt = [], rank
        for e in self.engines:
            firsts.append((specs, nxt))
            nxt += int(e.weight_workers)
        return self.start_all("join_weight_groups", firsts)

    def receive_weights(self, version: int, kind: str) -> set[str]:
        return self.finish_receive(self.start_receive(version, kind))

    def start_receive(self, version: int, kind: str) -> list[Any]:
        """Every engine starts taking a sync off the weight groups (the trainer ranks send meanwhile)."""
        return self.start_all("receive_weights", [(version, kind)] * len(self.engines))

    def finish_receive(self, refs: Sequence[Any]) -> set[str]:
        changed: set[str] = set()
        for c in self.wait_all(refs):
            changed |= set(c)
        return changed

    def shutdown(self) -> None:
        self._fan("shutdown")

    # -- metrics -----------------------------------------------------------------------------
    def load_metrics(self) -> dict[str, float]:
        """``rollout/engines``, and the requests (prompt groups) each engine got since the last call."""
        n = len(self.engines)
        m: dict[str, float] = {
            "rollout/engines": float(n),
            "rollout/engine_load": sum(self.requests_window) / n,
            "rollout/engine_load_max": float(max(self.requests_window)),
            "rollout/engine_load_min": float(min(self.requests_window)),
        }
        for name, c in zip(self.names, self.requests_window, strict=True):
            m[f"rollout/engine_load/{name}"] = float(c)
        self.requests_window = [0] * n
        return m
