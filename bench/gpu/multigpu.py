"""The runs a multi-GPU machine owes (issue 14): FSDP2 scaling, 4+4 separate_async vs sync, colocate_async
vs sync, each as ``rlkube-train`` on a local Ray over the machine's GPUs, one JSON of results.

    python bench/gpu/multigpu.py --gpus 8 [--size 0.5b] [--steps 20] [--vendor nvidia|amd] [--only NAME]

Needs rlkube installed with Ray (and vLLM for ``--engine vllm``) on a node with ``--gpus`` GPUs. It
writes a random-init Qwen2.5-shaped model (char tokenizer) and the arithmetic task under
``--work`` (no download), then runs, each for ``--steps`` steps after the first (warm-up) one:

- ``fsdp2-<n>``: sync, n = 1, 2, 4 trainer GPUs (colocated engines on the same GPUs): tokens/s and
  step time against n (FSDP2 1 -> 4 scaling);
- ``sync-8`` vs ``separate-4+4``: all 8 GPUs colocated in sync, against 4 trainer + 4 rollout GPUs
  in separate_async (the seed's layout);
- ``colocate-8`` vs ``sync-8``: colocate_async against sync on the same 8 GPUs.

Each run's mean ``perf/tokens_per_s``, ``timing_s/step``, ``timing_s/update_weights``,
``weight_sync/transport`` and its ``layout.json`` land in ``$OUT/multigpu.json`` (or ``--work``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

VOCAB = "0123456789+-= "


def prepare(work: Path, size: str) -> tuple[Path, Path]:
    """A random-init model of ``size``'s shapes with a char tokenizer, and the arithmetic prompts."""
    from rlkube.runtime.data import make_arith_records, write_jsonl
    from rlkube.runtime.models.tiny import make_char_tokenizer, qwen2_like_config

    model_dir = work / f"qwen2-{size}"
    if not (model_dir / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM

        tok = make_char_tokenizer(VOCAB)
        cfg = qwen2_like_config(size)
        cfg.vocab_size = max(len(tok), 64)
        cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 1, 2
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    data = work / "train.jsonl"
    if not data.exists():
        write_jsonl(make_arith_records(2000, seed=0, max_operand=99), data)
    return model_dir, data


def spec(
    model: Path,
    data: Path,
    name: str,
    mode: str,
    trainer: dict[str, Any],
    args: argparse.Namespace,
    **over: Any,
) -> dict[str, Any]:
    s: dict[str, Any] = {
        "model": {"path": str(model), "dtype": "bfloat16"},
        "data": {"train": str(data), "reward": "arith", "maxPromptLength": 16, "maxResponseLength": 256},
        "algorithm": {"name": "grpo", "groupSize": 8},
        "training": {
            "mode": mode,
            "totalSteps": args.steps + 1,
            "trainBatchSize": 32,
            "miniBatchSize": 32,
            "microBatchSize": 8,
            "learningRate": 1e-6,
        },
        "trainer": trainer,
        "rollout": {"engine": args.engine},
        "gpu": {"vendor": args.vendor},
        "checkpoint": {"intervalSteps": 10_000},
    }
    for k, v in over.items():
        s[k] = {**s.get(k, {}), **v} if isinstance(v, dict) else v
    return {"apiVersion": "rlkube.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": s}


def runs(model: Path, data: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out = {}
    for n in (1, 2, 4):
        out[f"fsdp2-{n}"] = spec(model, data, f"fsdp2-{n}", "sync", {"gpusPerReplica": n}, args)
    half = args.gpus // 2
    out[f"sync-{args.gpus}"] = spec(model, data, "sync-all", "sync", {"gpusPerReplica": args.gpus}, args)
    out[f"separate-{half}+{half}"] = spec(
        model,
        data,
        "separate",
        "separate_async",
        {"gpusPerReplica": half},
        args,
        rollout={"gpusPerReplica": half, "replicas": 1},
        training={"trainBatchSize": 32, "miniBatchSize": 8},
        **{"async": {"parameterSyncStep": 4, "stalenessThreshold": 1.0}},
    )
    out[f"colocate-{args.gpus}"] = spec(
        model,
        data,
        "colocate",
        "colocate_async",
        {"gpusPerReplica": args.gpus},
        args,
        **{"async": {"stalenessThreshold": 1.0}},
    )
    return out


def summarize(out_dir: Path) -> dict[str, Any]:
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = [r for r in rows if r.get("step", 0) > 1] or rows

    def mean(key: str) -> float | None:
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    return {
        "steps": len(rows),
        "tokens_per_s": mean("perf/tokens_per_s"),
        "tokens_per_s_per_gpu": mean("perf/tokens_per_s_per_gpu"),
        "step_s": mean("timing_s/step"),
        "update_actor_s": mean("timing_s/update_actor"),
        "update_weights_s": mean("timing_s/update_weights"),
        "transport": rows[-1].get("weight_sync/transport") if rows else None,
        "layout": json.loads((out_dir / "layout.json").read_text())
        if (out_dir / "layout.json").exists()
        else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--size", default="0.5b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--vendor", default="amd", choices=["amd", "nvidia"])
    p.add_argument("--work", type=Path, default=Path("/tmp/rlkube-multigpu"))
    p.add_argument("--only", default=None, help="comma-separated run names")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.work, args.size)
    results: dict[str, Any] = {"gpus": args.gpus, "size": args.size, "engine": args.engine, "runs": {}}
    dest = Path(os.environ.get("OUT", args.work)) / "multigpu.json"
    for name, doc in runs(model, data, args).items():
        if args.only and name not in args.only.split(","):
            continue
        job = args.work / f"{name}.yaml"
        job.write_text(yaml.safe_dump(doc))
        out = args.work / name
        cmd = [sys.executable, "-m", "rlkube.runtime.train", "--rljob", str(job), "--output", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        entry: dict[str, Any] = {"returncode": done.returncode}
        if done.returncode == 0:
            entry.update(summarize(out))
        else:
            entry["stderr"] = done.stderr[-3000:]
        results["runs"][name] = entry
        dest.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0 if all(r["returncode"] == 0 for r in results["runs"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
