"""Trainer ranks in spawned processes over a real gloo world, without Ray.

Rank 0 runs the real ``Trainer`` with its peers reached through a pipe (:class:`PipePeer` answers
``peer.call.remote(method, ...)`` as a Ray actor handle does, with a future); every other rank runs
the real ``Learner`` in a loop serving those calls. The maths (FSDP2 over gloo, the split, the
global loss denominators) is the runtime's own; only the call transport is not Ray.
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch


class _Reply:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def result(self) -> Any:
        status, value = self.conn.recv()
        if status == "err":
            raise RuntimeError(value)
        return value


class PipePeer:
    """A peer rank behind a pipe; ``peer.call.remote(method, *args)`` returns a future-like reply."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.call = self

    def remote(self, method: str, *args: Any, **kwargs: Any) -> _Reply:
        self.conn.send((method, args, kwargs))
        return _Reply(self.conn)

    def close(self) -> None:
        self.conn.send(None)


def run_ranks(procs: list[Any], out: Any, timeout_s: float = 600.0) -> Any:
    """Start the rank processes and return what rank 0 puts on ``out``; every process must exit 0,
    and none outlives the call (a hung rank is killed, so a failure never leaves processes behind)."""
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=timeout_s)
        for p in procs:
            p.join(timeout=60)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def join_world(rank: int, world: int, port: int) -> None:
    from rlkube.runtime.distributed.groups import Rendezvous, init_trainer_world

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    if world > 1:
        init_trainer_world(Rendezvous("127.0.0.1", port, world, "gloo", 120.0), rank)


def serve_learner(rank: int, world: int, port: int, job_path: str, conn: Any) -> None:
    """A peer rank: join the world, build the Learner, answer calls until told to stop."""
    from rlkube.api import load_rljob, resolve
    from rlkube.runtime.distributed.groups import leave_trainer_world
    from rlkube.runtime.distributed.ranks import LEARNER_CALLS
    from rlkube.runtime.trainer.learner import Learner

    join_world(rank, world, port)
    learner = Learner(resolve(load_rljob(job_path)).spec)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            method, args, kwargs = msg
            assert method in LEARNER_CALLS, method
            try:
                conn.send(("ok", getattr(learner, method)(*args, **kwargs)))
            except Exception as e:  # handed to rank 0, which raises RankFailed
                conn.send(("err", repr(e)))
    finally:
        leave_trainer_world()


def fixed_samples(trainer: Any, groups: int = 4, group_size: int = 4) -> list[Any]:
    """A fixed batch of scored samples (random responses over the tiny vocabulary)."""
    from rlkube.runtime.trainer.batch import Sample

    rng = random.Random(7)
    vocab = int(trainer.actor.model.config.vocab_size)
    out = []
    for g, ref in enumerate(trainer.next_prompts(groups)):
        for _ in range(group_size):
            resp = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 4))]
            r = float(rng.random() < 0.5)
            out.append(Sample(ref.prompt_ids, resp, f"p{g}", 0, reward=r, score=r, accuracy=r))
    return out


def full_weights(trainer: Any) -> dict[str, Any]:
    """Rank 0's gathered full weights (every rank takes part in each gather), as numpy copies."""
    refs = trainer.learners.start_peers("iterate_full_parameters")
    weights = {k: v.clone().numpy() for k, v in trainer.learners.local.full_named_parameters()}
    trainer.learners.wait(refs)
    return weights
