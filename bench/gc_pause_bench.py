"""The garbage collector's full-collection pause in a warm rollout engine's process, and after freezing.

    .venv/bin/python bench/gc_pause_bench.py        # JSON in bench/results/gc-pause-cpu.json

A full collection walks every live Python object; a warm engine's process holds torch,
transformers, the model and its compiled code, so each walk stalls the decode loop (the GPU idles).
``HFEngine`` freezes the heap after its first call (``rlkube.runtime.heap.freeze_warm_heap``);
this times a full collection in such a process before and after that, with the object counts. It
uses a tiny random model on the CPU, compiled as on a GPU: the walk's cost is the host's, whatever
the device.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform as pyplatform
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def full_collections(repeats: int) -> list[float]:
    """Seconds per ``gc.collect()`` (all generations), ``repeats`` times."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/gc-pause-cpu.json"))
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from rlkube.runtime.models.tiny import tiny_qwen2_config
    from rlkube.runtime.rollout import RolloutRequest, SamplingParams
    from rlkube.runtime.rollout.hf import HFEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(64)).eval()
    # the engine must not freeze here: this measures the walk it saves
    with HFEngine(model=model, num_slots=8, max_seq_len=64, compile_step=True, freeze_heap=False) as eng:
        eng.generate([RolloutRequest("warm", [1, 2, 3], SamplingParams(n=8, max_tokens=16, seed=0))])
        live = len(gc.get_objects())
        before = full_collections(args.repeats)
        gc.freeze()
        frozen = gc.get_freeze_count()
        after = full_collections(args.repeats)
        gc.unfreeze()
    report: dict[str, Any] = {
        "benchmark": "gc-pause",
        "host": {"machine": pyplatform.machine(), "python": pyplatform.python_version()},
        "torch": torch.__version__,
        "live_objects": live,
        "frozen_objects": frozen,
        "full_collection_seconds": {"median": statistics.median(before), "all": before},
        "full_collection_seconds_frozen": {"median": statistics.median(after), "all": after},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{live} live objects: a full collection {1e3 * statistics.median(before):.1f} ms; "
        f"{frozen} frozen: {1e3 * statistics.median(after):.3f} ms"
    )
    return report


if __name__ == "__main__":
    main()
