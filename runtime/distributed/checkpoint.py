"""Model and optimiser shards in ``torch.distributed.checkpoint`` (DCP) format.

Every trainer rank writes its own FSDP2 shards (``__<rank>_0.distcp``) and rank 0 the global
``.metadata``, into the checkpoint directory the caller stages (atomicity, manifest, fallback and
pruning are ``rlkube.runtime.trainer.checkpoint``'s). DCP records every tensor's global shape and
each shard's offsets, so a checkpoint loads on any number of ranks: a job resumed with a different
trainer world size reshards on load. With one rank and no process group the same format is written
by the one process, so a one-process run and a multi-rank run share checkpoints.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MODEL_FILES_GLOB = "*.distcp"
METADATA = ".metadata"


def _state(stateful: dict[str, tuple[Any, Any, Any]]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    for name, (model, optim, sched) in stateful.items():
        msd, osd = get_state_dict(model, [optim] if optim is not None else [])
        out[name] = {"model": msd, "optim": osd}
        if sched is not None:  # the same on every rank: DCP stores one copy
            out[name]["scheduler"] = sched.state_dict()
    return out


def save_model_shards(path: str | Path, stateful: dict[str, tuple[Any, Any, Any]]) -> None:
    """Write ``{name: (model, optimizer, lr scheduler)}`` into ``path`` (collective over the ranks)."""
    import torch.distributed.checkpoint as dcp

    with _one_process_quiet(), _plain_errors("save"):
        dcp.save(_state(stateful), checkpoint_id=str(path))


def load_model_shards(path: str | Path, stateful: dict[str, tuple[Any, Any, Any]]) -> None:
    """Load ``{name: (model, optimizer, lr scheduler)}`` from ``path`` in place, resharded to this
    world (collective over the ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(stateful)
    with _one_process_quiet(), _plain_errors("load"):
        dcp.load(state, checkpoint_id=str(path))
    for name, (model, optim, sched) in stateful.items():
        set_state_dict(
            model,
            [optim] if optim is not None else [],
            model_state_dict=state[name]["model"],
            optim_state_dict=state[name]["optim"],
        )
        if sched is not None:
            sched.load_state_dict(state[name]["scheduler"])


@contextlib.contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group; one rank and no group is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def _plain_errors(what: str) -> Iterator[None]:
    """DCP raises ``CheckpointException``, a BaseException that slips past ``except Exception``
    (the checkpoint guard's clean-up and fallback, ``rlkube-train``'s one-line errors). Re-raise
    the first rank's OSError as itself (ENOSPC keeps its errno and file: the guard reports it),
    anything else as a RuntimeError naming the ranks."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = sorted(e.failures.items())
        causes = [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in failures]
        for _, exc in causes:
            if isinstance(exc, OSError):
                raise exc from None
        detail = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in causes)
        raise RuntimeError(f"checkpoint shards {what} failed: {detail}") from None


def has_model_shards(path: str | Path) -> bool:
    p = Path(path)
    return (p / METADATA).exists() and any(p.glob(MODEL_FILES_GLOB))
