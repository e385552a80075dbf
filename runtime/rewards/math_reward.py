"""MATH reward: the last ``\\boxed{}`` against the reference, by normalised string and then by
``math_verify`` (symbolic equivalence) in a pool of spawned processes with a per-item timeout.

A CAS call can hang on adversarial output (a huge power, a deep nest), and ``math_verify``'s own
timeout is signal-based, so it is only trustworthy in a process we can kill: an item that overruns
scores 0 and the pool is torn down and rebuilt; the other in-flight items are resubmitted.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import multiprocessing
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rlkube.runtime.rewards.base import RewardResult, check_batch
from rlkube.runtime.rewards.extract import answers_match, last_boxed, strip_boxed

VerifyFn = Callable[[str, str], bool]


def math_verify_equal(pred: str, truth: str) -> bool:
    """``math_verify.verify(parse(truth), parse(pred))``, both wrapped as inline LaTeX (runs in a worker)."""
    from math_verify import parse, verify

    gold = parse(f"${truth}$")
    answer = parse(f"${pred}$")
    if not gold or not answer:
        return False
    return bool(verify(gold, answer))


def _warmup(modules: tuple[str, ...], exercise_math_verify: bool) -> bool:
    for module in modules:
        importlib.import_module(module)
    if exercise_math_verify:  # the first parse builds sympy/LaTeX-parser state: keep it off the clock
        math_verify_equal("1", "1")
    return True


def _workers_of(pool: cf.ProcessPoolExecutor) -> list[multiprocessing.process.BaseProcess]:
    return list((getattr(pool, "_processes", None) or {}).values())


def _reap(processes: list[multiprocessing.process.BaseProcess], grace_s: float = 5.0) -> None:
    """Join every worker; one still alive after ``grace_s`` is SIGKILLed, so none outlives the pool."""
    deadline = time.monotonic() + grace_s
    for proc in processes:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=grace_s)


class MathVerifyPool:
    """Runs ``verify_fn(pred, truth)`` for many pairs in spawned workers, each with its own deadline.

    At most ``workers`` items are in flight; an item's clock starts when it is submitted to an idle
    (already started and warmed) worker, so pool start-up never counts against it. An item past its
    deadline scores ``(False, "timeout")`` and the pool is rebuilt. If a worker dies, the items that
    were in flight with it are retried one at a time, so only the one that kills a worker alone is
    reported ``"worker died"``.
    """

    def __init__(
        self,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        verify_fn: VerifyFn = math_verify_equal,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if workers <= 0 or timeout_s <= 0:
            raise ValueError("workers and timeout_s must be > 0")
        self.workers = workers
        self.timeout_s = timeout_s
        self.verify_fn = verify_fn
        self.startup_timeout_s = startup_timeout_s
        extra = ("math_verify",) if verify_fn is math_verify_equal else ()
        self._warm_modules: tuple[str, ...] = (verify_fn.__module__, *extra)
        self._pool: cf.ProcessPoolExecutor | None = None
        self.recycles = 0

    def _start(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            pool = cf.ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx)
            # One warm-up per worker: workers are spawned on demand, so this starts all of them.
            exercise = self.verify_fn is math_verify_equal
            warm = [pool.submit(_warmup, self._warm_modules, exercise) for _ in range(self.workers)]
            cf.wait(warm, timeout=self.startup_timeout_s)
            self._pool = pool
        return self._pool

    def _kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # ProcessPoolExecutor has no public way to stop a running task; terminate its workers.
        processes = _workers_of(pool)
        for proc in processes:
            proc.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        _reap(processes)
        self.recycles += 1

    def close(self) -> None:
        """Stop the workers and wait until each has exited (a later call starts a fresh pool)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            processes = _workers_of(pool)
            pool.shutdown(wait=True, cancel_futures=True)
            _reap(processes)

    def map(self, pairs: list[tuple[str, str]]) -> list[tuple[bool, str | None]]:
        """``(equal, error)`` per ``(pred, truth)``; error is ``"timeout"``, ``"worker died"`` or the
        exception the function raised."""
        results: list[tuple[bool, str | None] | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        suspects: deque[int] = deque()  # in flight when a worker died: retried alone
        in_flight: dict[cf.Future[bool], tuple[int, float, bool]] = {}  # index, start, isolated
        while pending or suspects or in_flight:
            pool = self._start()
            if suspects:
                if not in_flight:
                    i = suspects.popleft()
                    in_flight[pool.submit(self.verify_fn, *pairs[i])] = (i, time.monotonic(), True)
            else:
                while pending and len(in_flight) < self.workers:
                    i = pending.popleft()
                    in_flight[pool.submit(self.verify_fn, *pairs[i])] = (i, time.monotonic(), False)
            deadline = min(start for _, start, _ in in_flight.values()) + self.timeout_s
            done, _ = cf.wait(
                list(in_flight), timeout=max(0.0, deadline - time.monotonic()), return_when=cf.FIRST_COMPLETED
            )
            broken = False
            for fut in done:
                i, _start, isolated = in_flight.pop(fut)
                try:
                    results[i] = (bool(fut.result()), None)
                except BrokenProcessPool:
                    broken = True
                    if isolated:
                        results[i] = (False, "worker died")
                    else:
                        suspects.append(i)
                except Exception as e:
                    results[i] = (False, f"{type(e).__name__}: {e}")
            now = time.monotonic()
            overdue = [f for f, (_, start, _) in in_flight.items() if now - start >= self.timeout_s]
            if overdue or broken:
                for fut in overdue:
                    i, _start, _iso = in_flight.pop(fut)
                    results[i] = (False, "timeout")
                # The survivors restart on a fresh pool with fresh clocks.
                for i, _start, isolated in sorted(in_flight.values(), reverse=True):
                    if broken and not isolated:
                        suspects.appendleft(i)
                    else:
                        pending.appendleft(i)
                in_flight.clear()
                self._kill()
        return [r if r is not None else (False, "lost") for r in results]


class MathReward:
    """Hendrycks MATH reward: 1.0 if the last ``\\boxed{}`` equals the reference, else 0.0.

    Equal means equal after :func:`normalize_answer`, or, failing that, ``math_verify`` says so within
    ``timeout_s`` (``use_math_verify=False`` keeps the string check only). No box scores 0.
    """

    def __init__(
        self,
        *,
        use_math_verify: bool = True,
        workers: int = 2,
        timeout_s: float = 10.0,
        verify_fn: VerifyFn = math_verify_equal,
    ) -> None:
        self.use_math_verify = use_math_verify
        self.pool = MathVerifyPool(workers=workers, timeout_s=timeout_s, verify_fn=verify_fn)

    def __call__(
        self, prompts: list[str], responses: list[str], ground_truths: list[str]
    ) -> list[RewardResult]:
        check_batch(prompts, responses, ground_truths)
        preds = [last_boxed(r) for r in responses]
        truths = [strip_boxed(t) for t in ground_truths]
        verdict: list[tuple[bool, str | None, str]] = []
        to_verify: list[int] = []
        for i, (pred, truth) in enumerate(zip(preds, truths, strict=True)):
            if pred is None:
                verdict.append((False, None, "no_box"))
            elif answers_match(pred, truth):
                verdict.append((True, None, "string"))
            else:
                verdict.append((False, None, "string"))
                if self.use_math_verify:
                    to_verify.append(i)
        if to_verify:
            checked = self.pool.map([(str(preds[i]), truths[i]) for i in to_verify])
            for i, (ok, err) in zip(to_verify, checked, strict=True):
                verdict[i] = (ok, err, "math_verify")
        out = []
        for pred, (ok, err, how) in zip(preds, verdict, strict=True):
            extra: dict[str, Any] = {"pred": pred, "matched_by": how}
            if err is not None:
                extra["error"] = err
            out.append(RewardResult(score=1.0 if ok else 0.0, accuracy=ok, extra=extra))
        return out

    def close(self) -> None:
        self.pool.close()
