"""vLLM worker extension: RL weight loading, called by name through ``collective_rpc``.

vLLM mixes this class into its worker (``worker_extension_cls``), so methods run inside the worker
process next to the model, and arguments travel through vLLM's own msgpack serialiser (tensors,
lists, dicts, strings: no pickled callables, no insecure serialisation).

Why a snapshot: vLLM fuses q/k/v and gate/up and, on the CPU, even repacks linear weights into
oneDNN handles and frees the originals, so a delta cannot be applied to the live tensors. The
worker keeps an HF-named snapshot of what it last loaded; delta buckets are applied to the snapshot
(``apply_buckets`` verifies every checksum before writing anything), and then every *vLLM layer*
touched by a changed tensor is reloaded whole through vLLM's in-place reload (which re-runs the
kernel repacking), so no layer is ever half-written.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    str(d): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64)
}

# HF names that vLLM loads into one fused layer.
_FUSED = [
    (re.compile(r"^(.*\.self_attn\.)(q|k|v)_proj\.(weight|bias)$"), r"\1qkv"),
    (re.compile(r"^(.*\.mlp\.)(gate|up)_proj\.(weight|bias)$"), r"\1gate_up"),
]


def layer_group(name: str) -> str:
    """The vLLM layer an HF parameter is loaded into (fused q/k/v and gate/up share one)."""
    for pat, repl in _FUSED:
        if pat.match(name):
            return pat.sub(repl, name)
    return name.rsplit(".", 1)[0]


def tensor_to_wire(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as dtype + shape + raw bytes: vLLM's RPC path turns nested tensors into lists."""
    c = t.detach().cpu().contiguous()
    return {
        "dtype": str(c.dtype),
        "shape": list(c.shape),
        "data": c.view(-1).view(torch.uint8).numpy().tobytes(),
    }


def tensor_from_wire(d: dict[str, Any]) -> torch.Tensor:
    dtype = _DTYPES[d["dtype"]]
    if not d["data"]:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8).view(dtype).view(d["shape"])


def bucket_to_wire(bucket: Any) -> dict[str, Any]:
    """A ``WeightBucket`` as plain data vLLM's serialiser carries (dtypes as strings)."""
    return {
        "version": bucket.version,
        "kind": bucket.kind,
        "checksum": bucket.checksum,
        "index": bucket.index,
        "final": bucket.final,
        "base_version": bucket.base_version,
        "payload": tensor_to_wire(bucket.payload),
        "entries": [
            {
                "name": e.name,
                "shape": list(e.shape),
                "dtype": str(e.dtype),
                "kind": e.kind,
                "count": e.count,
                "values_offset": e.values_offset,
                "start": e.start,
                "positions_offset": e.positions_offset,
                "index_dtype": None if e.index_dtype is None else str(e.index_dtype),
            }
            for e in bucket.entries
        ],
    }


def bucket_from_wire(d: dict[str, Any]) -> Any:
    from rlkube.runtime.weights import BucketEntry, WeightBucket

    entries = tuple(
        BucketEntry(
            name=e["name"],
            shape=tuple(e["shape"]),
            dtype=_DTYPES[e["dtype"]],
            kind=e["kind"],
            count=e["count"],
            values_offset=e["values_offset"],
            start=e["start"],
            positions_offset=e["positions_offset"],
            index_dtype=None if e["index_dtype"] is None else _DTYPES[e["index_dtype"]],
        )
        for e in d["entries"]
    )
    return WeightBucket(
        version=d["version"],
        kind=d["kind"],
        entries=entries,
        payload=tensor_from_wire(d["payload"]),
        checksum=d["checksum"],
        index=d["index"],
        final=d["final"],
        base_version=d["base_version"],
    )


class WeightLoaderExtension:
    """Mixed into vLLM's worker; every public method is an RPC target (prefix ``rlkube_``)."""

    _rlkube_snapshot: dict[str, torch.Tensor] | None = None

    # vLLM's worker provides these.
    model_runner: Any
    vllm_config: Any

    def _rlkube_state(self) -> dict[str, torch.Tensor]:
        if self._rlkube_snapshot is None:
            from safetensors.torch import load_file

            mc = self.vllm_config.model_config
            files = sorted(Path(mc.model).glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no safetensors in {mc.model}: cannot build the weight snapshot")
            snap: dict[str, torch.Tensor] = {}
            for f in files:
                for k, v in load_file(str(f)).items():
                    snap[k] = v.to(mc.dtype).contiguous()
            self._rlkube_snapshot = snap
        return self._rlkube_snapshot

    def _rlkube_reload(self, names: Iterable[str]) -> list[str]:
        """Reload every vLLM layer touched by ``names`` from the snapshot, whole."""
        state = self._rlkube_state()
        groups = {layer_group(n) for n in names}
        full = sorted(n for n in state if layer_group(n) in groups)
        # Untouched layers keep their kernel tensors; vLLM logs a warning for each, which here is
        # the expected case, not a failure.
        log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            self.model_runner.reload_weights(
                weights_iterator=[(n, state[n]) for n in full], is_checkpoint_format=True
            )
        finally:
            log.setLevel(level)
        return full

    def rlkube_param_names(self) -> list[str]:
        """HF names the worker accepts."""
        return sorted(self._rlkube_state())

    def rlkube_load_hf_weights(self, names: list[str], wire: list[dict[str, Any]]) -> list[str]:
        """Full (or partial) HF-named tensors: update the snapshot, reload the layers they touch."""
        state = self._rlkube_state()
        tensors = [tensor_from_wire(d) for d in wire]
        for n, t in zip(names, tensors, strict=True):
            if n not in state:
                raise KeyError(f"unknown parameter {n!r}")
            if tuple(t.shape) != tuple(state[n].shape):
                raise ValueError(f"{n}: shape {tuple(t.shape)} != {tuple(state[n].shape)}")
        for n, t in zip(names, tensors, strict=True):
            state[n].copy_(t)
        self._rlkube_reload(names)
        return sorted(names)

    def rlkube_apply_buckets(self, wire: list[dict[str, Any]]) -> list[str]:
        """Checksum-verified buckets (dense or delta) applied to the snapshot, then reloaded."""
        from rlkube.runtime.weights import apply_buckets

        buckets = [bucket_from_wire(d) for d in wire]
        changed = apply_buckets(self._rlkube_state(), buckets)  # raises before writing on any mismatch
        if changed:
            self._rlkube_reload(changed)
        return sorted(changed)

    def rlkube_read_weights(self, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """The HF-named weights the worker last loaded into the model (the snapshot), on the wire."""
        state = self._rlkube_state()
        keys = sorted(state) if names is None else names
        return {k: tensor_to_wire(state[k]) for k in keys}

    def rlkube_join_weight_groups(self, specs: list[dict[str, Any]], first_rank: int) -> int:
        """Join the job's weight groups as ``first_rank`` + this worker's rank; returns the rank."""
        from rlkube.runtime.weights.collective import WeightGroupMember, WeightGroupSpec

        rank = first_rank + int(getattr(self, "rank", 0) or 0)
        device = None
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        member = WeightGroupMember()
        member.join([WeightGroupSpec(**d) for d in specs], rank, device)
        self._rlkube_member = member
        return rank

    def rlkube_receive_weights(self, kind: str, held_version: int) -> list[str]:
        """One sync over the weight groups into the snapshot; the layers it touched are reloaded."""
        from rlkube.runtime.rollout.base import check_base_version
        from rlkube.runtime.weights import apply_buckets

        member = getattr(self, "_rlkube_member", None)
        if member is None:
            raise RuntimeError("this vLLM worker has not joined the job's weight groups")
        state = self._rlkube_state()

        def apply(buckets: list[Any], complete: bool) -> set[str]:
            if complete:
                check_base_version(buckets, held_version)
            changed: set[str] = apply_buckets(state, buckets, complete)
            return changed

        # Payloads land on the snapshot's device (the host): the snapshot is what gets reloaded.
        changed = member.receive(kind, apply, torch.device("cpu"))
        if changed:
            self._rlkube_reload(changed)
        return sorted(changed)
