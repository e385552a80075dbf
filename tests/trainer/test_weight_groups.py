"""Weight sync across processes over the collective backend (gloo): two FSDP2 trainer ranks, two hf
engines each in its own process, joined by the job's weight groups.

After every ``full`` sync (rank 0 gathers the shards one tensor at a time and streams them) and every
``delta_sharded`` sync (each rank streams the changed pairs of its own shard), both engines hold
exactly the trainer's gathered weights, bit for bit; deltas ship a small fraction of a full sync.
(One set of processes runs full syncs, then deltas, to keep the test's start-up cost paid once.)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest
import torch

from rlkube.runtime.distributed.groups import free_port

from .conftest import write_job
from .rank_peers import PipePeer, join_world

STEPS = 3


def _trainer_rank(rank: int, port: int, job_path: str, conn: Any) -> None:
    from rlkube.api import load_rljob, resolve
    from rlkube.runtime.distributed.groups import leave_trainer_world
    from rlkube.runtime.trainer.learner import Learner

    join_world(rank, 2, port)
    learner = Learner(resolve(load_rljob(job_path)).spec)

    def perturb(version: int) -> None:
        """A training step's worth of change: 1% of each rank's own shard, seeded by version and rank."""
        gen = torch.Generator().manual_seed(1000 * version + rank)
        with torch.no_grad():
            for p in learner.actor.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                flat = local.view(-1)
                if flat.numel():
                    idx = torch.randperm(flat.numel(), generator=gen)[: max(1, flat.numel() // 100)]
                    flat[idx] += 0.01

    def full() -> dict[str, Any]:
        return {k: v.clone().numpy() for k, v in learner.full_named_parameters()}

    calls = {
        "perturb": perturb,
        "full": full,
        "join_weight_groups": learner.join_weight_groups,
        "send_weights": learner.send_weights,
        "reset_sender": learner.sender.reset,
    }
    _serve(conn, calls)
    leave_trainer_world()


def _engine(model_dir: str, conn: Any) -> None:
    from rlkube.runtime.rollout.hf import HFEngine

    torch.set_num_threads(1)
    engine = HFEngine(model_dir, dtype="float32", num_slots=4, max_seq_len=16)

    def weights() -> dict[str, Any]:
        return {k: v.detach().clone().numpy() for k, v in engine.named_parameters().items()}

    calls = {
        "join_weight_groups": engine.join_weight_groups,
        "receive_weights": lambda v, kind: sorted(engine.receive_weights(v, kind)),
        "weights": weights,
        "capabilities": lambda: engine.capabilities.distributed_weights,
    }
    _serve(conn, calls)
    engine.shutdown()


def _serve(conn: Any, calls: dict[str, Any]) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args, kwargs = msg
        try:
            conn.send(("ok", calls[method](*args, **kwargs)))
        except Exception as e:
            conn.send(("err", repr(e)))


def _all(peers: list[PipePeer], method: str, *args: Any) -> list[Any]:
    replies = [p.call.remote(method, *args) for p in peers]
    return [r.result() for r in replies]


def test_engines_bit_identical_to_gathered_trainer_weights(tmp_path: Path, tiny_task: Any) -> None:
    from rlkube.runtime.weights.collective import weight_group_specs

    job = write_job(tmp_path / "job.yaml", tiny_task, weightSync={"bucketMegabytes": 1})
    ctx = mp.get_context("spawn")
    port = free_port("127.0.0.1")
    pipes = [ctx.Pipe() for _ in range(4)]
    procs = [ctx.Process(target=_trainer_rank, args=(r, port, str(job), pipes[r][1])) for r in range(2)]
    procs += [ctx.Process(target=_engine, args=(str(tiny_task.model_dir), pipes[2 + e][1])) for e in range(2)]
    for p in procs:
        p.start()
    trainers = [PipePeer(pipes[r][0]) for r in range(2)]
    engines = [PipePeer(pipes[2 + e][0]) for e in range(2)]
    try:
        assert _all(engines, "capabilities") == [True, True]
        # One group per trainer rank: full syncs use rank 0's, deltas every rank's.
        specs = weight_group_specs("127.0.0.1", free_port("127.0.0.1"), [0, 1], 2, "gloo", 120.0)
        joins = [t.call.remote("join_weight_groups", specs) for t in trainers]
        joins += [e.call.remote("join_weight_groups", specs, 1 + i) for i, e in enumerate(engines)]
        for j in joins:
            j.result()
        payloads: dict[str, list[float]] = {"full": [], "delta_sharded": []}
        for version, method in enumerate(["full"] * STEPS + ["delta_sharded"] * STEPS):
            if version:
                _all(trainers, "perturb", version)
            if version == STEPS:  # a job syncs one way throughout: deltas start from fresh snapshots
                _all(trainers, "reset_sender")
            kind = "delta" if method == "delta_sharded" else "full"
            recv = [e.call.remote("receive_weights", version, kind) for e in engines]
            stats = _all(trainers, "send_weights", version, method)
            changed = [r.result() for r in recv]
            assert changed[0] == changed[1] and changed[0]
            if method == "delta_sharded":
                assert all(stats), "every rank sent the delta of its own shard"
            payloads[method].append(sum(s.get("payload_mb", 0.0) for s in stats))
            expected = _all(trainers, "full")[0]
            for got in _all(engines, "weights"):
                assert got.keys() == expected.keys()
                bad = [k for k in expected if not (got[k] == expected[k]).all()]
                assert not bad, (
                    f"{method} version {version}: the engine differs from the trainer on {bad[:3]}"
                )
        full, delta = payloads["full"], payloads["delta_sharded"]
        assert full[1] == pytest.approx(full[0])
        # The first delta seeds the shard snapshots (dense); later ones ship ~1% x 8/4 bytes.
        assert all(d < full[0] * 0.1 for d in delta[1:]), payloads
    finally:
        for peer in [*trainers, *engines]:
            with contextlib.suppress(BrokenPipeError, OSError):
                peer.close()
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
