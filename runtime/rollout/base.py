"""The one rollout interface the trainer talks to, whatever engine sits behind it.

Token ids in, token ids + per-token logprobs out. Every completion records which policy version
produced each of its tokens, because partial rollout (abort, sync weights, resume) mixes versions
inside one sample and the trainer's staleness accounting needs to know.

Logprob convention (all engines): ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the
*raw* model distribution, ``log_softmax(logits)`` at temperature 1, before temperature, top-p or any
other sampling processor. That is vLLM's default ``logprobs_mode="raw_logprobs"`` and what a
teacher-forced trainer forward returns without extra arguments; a trainer that wants the
temperature-scaled distribution rescales both sides the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]
LOGPROBS_MODE = "raw"  # see module docstring


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one prompt; ``n`` independent samples are drawn from it.

    ``seed`` makes a request reproducible on the same engine and weights: sample ``k`` of a request
    uses a stream derived from ``(seed, k)``. ``temperature == 0`` means greedy.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt (token ids) to sample ``params.n`` completions for."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    """One sample of one request, finished or aborted.

    ``prompt_ids`` is always the *original* prompt; ``token_ids`` all response tokens so far, across
    resumes. ``token_versions[i]`` is the policy version whose weights sampled ``token_ids[i]``;
    ``policy_version`` is the version when the request started (the sample's staleness anchor).
    An aborted completion (``finish_reason == "abort"``) can be handed to ``resume``.
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    token_versions: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)

    @property
    def key(self) -> tuple[str, int]:
        """Identity of the sample across abort/resume."""
        return (self.request_id, self.sample_index)

    @property
    def resumed_versions(self) -> list[int]:
        """Versions that continued this sample after it started, in order (empty if never resumed)."""
        out: list[int] = []
        for v in self.token_versions:
            if v != self.policy_version and (not out or out[-1] != v):
                out.append(v)
        return out

    @property
    def remaining_tokens(self) -> int:
        """Token budget left for a resume."""
        return max(self.params.max_tokens - len(self.token_ids), 0)

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """Append a continuation segment produced under ``version``."""
        self.token_ids.extend(map(int, token_ids))  # map: half the time of a generator (512 x 256 tokens)
        self.logprobs.extend(map(float, logprobs))
        self.token_versions.extend([version] * len(token_ids))


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine really does on this platform; the trainer branches on these, never on names."""

    engine: str
    sleep: bool = False
    sleep_levels: tuple[int, ...] = ()
    abort_resume: bool = True
    async_submit: bool = True
    full_weights: bool = True
    delta_weights: bool = False
    distributed_weights: bool = False
    # load_weights copies straight from the caller's tensors in this process (no buckets needed)
    direct_weights: bool = False
    logprobs_mode: str = LOGPROBS_MODE
    notes: str = ""


@runtime_checkable
class RolloutEngine(Protocol):
    """The rollout engine contract (see docs/rollout.md).

    ``generate`` is the blocking batch call. ``submit``/``poll``/``abort_all``/``resume`` are the
    asynchronous path used by the async trainer modes: ``poll`` returns completions that finished
    since the last call, ``abort_all`` stops everything in flight and returns the partial samples
    (tokens kept, ``finish_reason="abort"``), ``resume`` continues partials (typically under new
    weights) with the partial's tokens treated as prompt, so continuation logprobs are under the new
    policy and ``token_versions`` says which version produced which token.
    """

    @property
    def capabilities(self) -> EngineCapabilities: ...

    @property
    def policy_version(self) -> int: ...

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]: ...

    def submit(self, requests: Sequence[RolloutRequest]) -> None: ...

    def poll(self) -> list[Completion]: ...

    def num_in_flight(self) -> int: ...

    def abort_all(self) -> list[Completion]: ...

    def resume(self, partials: Sequence[Completion]) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def update_weights(self, buckets: Iterable[Any], version: int) -> set[str]: ...

    @property
    def weight_workers(self) -> int:
        """Processes that join the job's weight groups (tensor-parallel workers; 0: cannot)."""
        ...

    def join_weight_groups(self, specs: list[Any], rank: int) -> None:
        """Join the job's weight groups (``rlkube.runtime.weights.collective``), workers from ``rank``."""
        ...

    def receive_weights(self, version: int, kind: str) -> set[str]:
        """Take one sync off the weight groups (``kind``: "full" or "delta")."""
        ...

    def shutdown(self) -> None: ...


class UnsupportedCapability(RuntimeError):
    """Raised when a caller asks for something ``capabilities`` says the engine cannot do."""


def expand_samples(requests: Sequence[RolloutRequest]) -> list[tuple[RolloutRequest, int]]:
    """(request, sample_index) for every sample, in request order."""
    seen: set[str] = set()
    out: list[tuple[RolloutRequest, int]] = []
    for r in requests:
        if r.request_id in seen:
            raise ValueError(f"duplicate request_id {r.request_id!r}")
        seen.add(r.request_id)
        out.extend((r, k) for k in range(r.params.n))
    return out


def sample_seed(params: SamplingParams, sample_index: int, offset: int = 0) -> int | None:
    """Per-sample seed derived from the request seed (``None`` stays unseeded).

    ``offset`` (tokens already generated) gives a resumed segment a fresh but reproducible stream.
    """
    if params.seed is None:
        return None
    return (params.seed * 1_000_003 + sample_index * 7919 + offset * 104_729) % (2**63 - 1)


def continuation_params(partial: Completion) -> SamplingParams:
    """Sampling params for the rest of a partial: one sample, the remaining token budget."""
    return replace(partial.params, n=1, max_tokens=partial.remaining_tokens)


def check_resumable(partials: Iterable[Completion]) -> list[Completion]:
    """The partials, after checking each was aborted (only those can continue)."""
    out = list(partials)
    for c in out:
        if c.finish_reason != "abort":
            raise ValueError(f"{c.key}: only aborted completions can be resumed ({c.finish_reason})")
    return out


def in_request_order(
    completions: Iterable[Completion], requests: Sequence[RolloutRequest]
) -> list[Completion]:
    """Completions sorted as ``generate`` returns them: by request position, then sample index."""
    order = {r.request_id: i for i, r in enumerate(requests)}
    return sorted(completions, key=lambda c: (order[c.request_id], c.sample_index))


class ThreadedEngine:
    """What the engines driven by a background thread share: the finished queue, ``poll``,
    the blocking ``generate`` on top of ``submit`` and the failure hand-off from the thread.

    Subclasses set ``_name``, call ``_init_queue()`` and implement ``submit`` and
    ``_in_flight_locked(ids)`` (called holding ``_cv``: are samples of ``ids`` still running?).
    """

    _name = "rollout"

    def _init_queue(self) -> None:
        self._cv = threading.Condition()
        self._finished: list[Completion] = []
        self._error: BaseException | None = None

    def submit(self, requests: Sequence[RolloutRequest]) -> None:
        raise NotImplementedError

    def _in_flight_locked(self, ids: set[str]) -> bool:
        raise NotImplementedError

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self._name} rollout loop failed") from self._error

    def poll(self) -> list[Completion]:
        """Completions finished since the last call (never blocks)."""
        with self._cv:
            self._raise_if_failed()
            out, self._finished = self._finished, []
            return out

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Completion]:
        """Blocking batch call: completions in request order, samples in index order."""
        ids = {r.request_id for r in requests}
        want = sum(r.params.n for r in requests)
        self.submit(requests)
        with self._cv:
            while True:
                self._raise_if_failed()
                mine = [c for c in self._finished if c.request_id in ids]
                if len(mine) >= want or not self._in_flight_locked(ids):
                    self._finished = [c for c in self._finished if c.request_id not in ids]
                    break
                self._cv.wait(timeout=1.0)
        return in_request_order(mine, requests)


def sort_completions(completions: Iterable[Completion]) -> list[Completion]:
    """Stable order for tests and logs: by request id then sample index."""
    return sorted(completions, key=lambda c: (c.request_id, c.sample_index))


def check_base_version(buckets: Sequence[Any], held_version: int) -> None:
    """Refuse a delta sync built against weights this engine does not hold (a missed sync)."""
    if not buckets:
        return
    base = getattr(buckets[0], "base_version", None)
    if base is not None and base != held_version:
        from rlkube.runtime.weights import WeightSyncError

        raise WeightSyncError(
            f"delta to version {buckets[0].version} is against version {base}, but the engine holds "
            f"{held_version}: the sender must reset() and sync dense"
        )
