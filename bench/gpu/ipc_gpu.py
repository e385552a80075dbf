"""Trainer -> engine weight sync by CUDA IPC: two processes on one GPU, against the copy bandwidth.

The "trainer" process holds bf16 weights with Qwen2.5-0.5B / 7B shapes and streams a full sync as
checksummed buckets (``WeightSender.full``, 512 MiB); each bucket's payload is handed to the
"engine" process as an IPC handle (``rlkube.runtime.weights.ipc``) over a pipe; the engine maps it,
verifies the checksum and copies the values into its own weights, then acks so the trainer may
drop the bucket. Seconds are end to end (pack, handle, map, verify, apply) for the whole model,
median of 3 after one warm-up sync; GB/s counts the model's bytes once, against the D2D copy
bandwidth measured in the same run (counted once too: bytes copied / s). At the end the engine
compares every tensor with the trainer's (mapped through IPC as well): bit-identical or it fails.

    python bench/gpu/ipc_gpu.py [--sizes 0.5b,7b]        # JSON on stdout and in $OUT/ipc-gpu.json

One GPU, torch only (no Ray, no vLLM, no pydantic; rlkube need not be installed: ``_common.import_rlkube``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# rlkube from this checkout without an install (and without pydantic); at import, so the spawned
# engine process (which re-imports this file) maps it too.
_spec = importlib.util.spec_from_file_location("rlkube_bench_common", Path(__file__).with_name("_common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
common.import_rlkube()

BUCKET_MB = 512


def _shapes(size: str) -> dict[str, tuple[int, ...]]:
    from rlkube.runtime.models.tiny import make_qwen2_like

    meta = make_qwen2_like(size, dtype=torch.bfloat16, device="meta")
    return {k: tuple(v.shape) for k, v in meta.state_dict().items()}


def copy_bandwidth(device: torch.device) -> float:
    """D2D bytes/s counted once (1 GiB copies, median of 10)."""
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return x.numel() / statistics.median(times)


def _engine(conn: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    from rlkube.runtime.weights import apply_buckets
    from rlkube.runtime.weights.ipc import open_bucket

    dev = torch.device("cuda", 0)
    state = {k: torch.zeros(s, dtype=torch.bfloat16, device=dev) for k, s in shapes.items()}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, ipc = msg
        if kind == "bucket":
            bucket = open_bucket(ipc)
            apply_buckets(state, [bucket], complete=False)  # checksum verified before writing
            torch.cuda.synchronize()
            del bucket
            conn.send("ok")
        elif kind == "compare":  # ipc: {name: handle of the trainer's tensor}
            bad = []
            for k, (rebuild, args) in ipc.items():
                if not torch.equal(state[k], rebuild(*args)):
                    bad.append(k)
            conn.send(bad)


def bench_size(size: str, repeats: int) -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    from rlkube.runtime.weights import WeightSender
    from rlkube.runtime.weights.ipc import IpcSender

    dev = torch.device("cuda", 0)
    shapes = _shapes(size)
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = {
        k: torch.randn(s, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
        for k, s in shapes.items()
    }
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(there, shapes))
    proc.start()
    sender = WeightSender(bucket_megabytes=BUCKET_MB, dtype=torch.bfloat16, keep_snapshots=False)
    times, buckets = [], 0
    try:
        for i in range(repeats + 1):
            for t in weights.values():  # a training step's worth of change: the sync must carry it
                t.view(-1)[i::997] += 1
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            stream = IpcSender(sender.full(weights.items(), version=i))
            n = 0
            while (ipc := stream.next()) is not None:
                here.send(("bucket", ipc))
                assert here.recv() == "ok"
                n += 1
            stream.release()
            dt = time.perf_counter() - t0
            if i:
                times.append(dt)
            buckets = n
        here.send(("compare", {k: reduce_tensor(v) for k, v in weights.items()}))
        bad = here.recv()
    finally:
        here.send(None)
        proc.join(timeout=120)
    sec = statistics.median(times)
    return {
        "size": size,
        "tensors": len(shapes),
        "bytes": nbytes,
        "buckets": buckets,
        "seconds": sec,
        "seconds_all": times,
        "gb_per_s": nbytes / sec / 1e9,
        "bit_identical": not bad,
        "mismatched": bad[:5],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.5b,7b")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    bw = copy_bandwidth(dev)
    out: dict[str, Any] = {
        "bench": "ipc-gpu",
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "bucket_mb": BUCKET_MB,
        "copy_gb_per_s": bw / 1e9,
        "results": [],
    }
    for size in args.sizes.split(","):
        r = bench_size(size, args.repeats)
        r["fraction_of_copy"] = r["gb_per_s"] / (bw / 1e9)
        out["results"].append(r)
        torch.cuda.empty_cache()
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "ipc-gpu.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0 if all(r["bit_identical"] for r in out["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
