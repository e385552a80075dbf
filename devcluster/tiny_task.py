"""The tiny arithmetic task the demo and the learning tests train on, prepared in seconds.

A random-init tiny Qwen2 (char tokenizer) gets a *short* supervised warm start on a few
arithmetic problems, the way real post-training starts from a pretrained model: afterwards it
answers in the right format but is mostly wrong on held-out prompts, so whatever the RL run adds
on top is a genuine RL gain, not supervised learning in disguise.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkube.api.contract import API_VERSION, KIND
from rlkube.runtime.data import make_arith_records, write_jsonl
from rlkube.runtime.data.records import Record

VOCAB = "0123456789+-="
TASK_FILE = "rlkube_task.json"


@dataclass(frozen=True)
class TinyTask:
    """Paths of a prepared task: the warm-started model and the train / held-out prompt files."""

    model_dir: Path
    train_path: Path
    heldout_path: Path
    warm_accuracy: float  # greedy held-out accuracy right after the warm start


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Prompt token ids: BOS + one id per character (the tiny tokenizer adds no BOS itself)."""
    return [int(tokenizer.bos_token_id), *tokenizer(prompt, add_special_tokens=False).input_ids]


def sft_warm_start(
    model: torch.nn.Module,
    tokenizer: Any,
    records: Sequence[Record],
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
) -> None:
    """Supervised steps on ``prompt -> answer<eos>`` (loss on the answer only), in place."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id)
    model.train()
    for _ in range(steps):
        batch = [records[rng.randrange(len(records))] for _ in range(batch_size)]
        seqs, masks = [], []
        for r in batch:
            p = encode_prompt(tokenizer, r.prompt)
            a = [*tokenizer(r.answer, add_special_tokens=False).input_ids, eos]
            seqs.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        lab_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        target = ids[:, 1:]
        lmask = lab_mask[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[lmask], target[lmask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


@torch.no_grad()
def greedy_accuracy(
    model: torch.nn.Module, tokenizer: Any, records: Sequence[Record], max_new: int = 4
) -> float:
    """Greedy exact-answer accuracy (the ``arith`` reward) with a plain batched forward loop."""
    from rlkube.runtime.rewards import get_reward_fn

    reward = get_reward_fn("arith")
    eos = int(tokenizer.eos_token_id)
    prompts = [encode_prompt(tokenizer, r.prompt) for r in records]
    # All prompts of one length decode together; arithmetic prompts have few distinct lengths.
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    responses = [""] * len(records)
    for idxs in by_len.values():
        ids = torch.tensor([prompts[i] for i in idxs])
        out: list[list[int]] = [[] for _ in idxs]
        done = [False] * len(idxs)
        for _ in range(max_new):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    if t == eos:
                        done[j] = True
                    else:
                        out[j].append(t)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            if all(done):
                break
        for j, i in enumerate(idxs):
            responses[i] = tokenizer.decode(out[j], skip_special_tokens=True)
    results = reward([r.prompt for r in records], responses, [r.answer for r in records])
    return sum(float(x.score) for x in results) / max(len(results), 1)


def prepare_tiny_task(
    out_dir: str | Path,
    *,
    seed: int = 0,
    max_operand: int = 19,
    ops: str = "+",
    heldout: int = 60,
    sft_steps: int = 65,
    sft_examples: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
) -> TinyTask:
    """Make the tiny model, warm-start it, and write ``train.jsonl`` / ``heldout.jsonl``.

    ``sft_examples`` > 0 restricts the warm start to that many training prompts (format, little
    skill); 0 uses all of them. Re-running with the same arguments reuses what is already there.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkube.runtime.models.tiny import make_tiny_qwen2

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    args = dict(
        seed=seed,
        max_operand=max_operand,
        ops=ops,
        heldout=heldout,
        sft_steps=sft_steps,
        sft_examples=sft_examples,
        hidden_size=hidden_size,
        num_layers=num_layers,
    )
    meta_path = out / TASK_FILE
    model_dir = out / "model"
    train_path, heldout_path = out / "train.jsonl", out / "heldout.jsonl"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("args") == args:
            return TinyTask(model_dir, train_path, heldout_path, float(meta["warm_accuracy"]))
    records = _all_records(max_operand, ops, seed)
    held, train = records[:heldout], records[heldout:]
    torch.manual_seed(seed)
    make_tiny_qwen2(model_dir, vocab=VOCAB, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sft_set = train[:sft_examples] if sft_examples > 0 else train
    sft_warm_start(model, tok, sft_set, steps=sft_steps, seed=seed)
    model.save_pretrained(model_dir, safe_serialization=True)
    write_jsonl(train, train_path)
    write_jsonl(held, heldout_path)
    acc = greedy_accuracy(model, tok, held)
    meta_path.write_text(json.dumps({"args": args, "warm_accuracy": acc}))
    return TinyTask(model_dir, train_path, heldout_path, acc)


def _all_records(max_operand: int, ops: str, seed: int) -> list[Record]:
    """Every distinct problem of the task, shuffled deterministically."""
    total = 0
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                if op != "-" or a >= b:
                    total += 1
    return make_arith_records(total, seed=seed, max_operand=max_operand, ops=ops)


# The demo's trainer pod: one CPU and 2Gi (the learning tests keep the API defaults instead).
DEMO_TRAINER: dict[str, Any] = {"replicas": 1, "gpusPerReplica": 0, "cpusPerReplica": 1, "memory": "2Gi"}


def merge_spec(spec: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`spec` with each `over` section merged one level deep (a non-dict value replaces the section)."""
    out = dict(spec)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_rljob(
    task: TinyTask,
    *,
    name: str = "tiny-arith",
    mode: str = "sync",
    steps: int = 150,
    trainer: dict[str, Any] | None = None,
    **over: Any,
) -> dict[str, Any]:
    """The RLJob (wire form) that trains the tiny task on CPU: what the demo applies and runs, and the
    one the learning and trainer tests start from.

    `trainer` replaces the trainer block (default DEMO_TRAINER: the resources it asks Ray for);
    `over` merges into spec sections one level deep (e.g. training={"totalSteps": 4}).
    """
    spec: dict[str, Any] = {
        "model": {"path": str(task.model_dir), "dtype": "float32", "gradientCheckpointing": False},
        "data": {
            "train": str(task.train_path),
            "validation": str(task.heldout_path),
            "reward": "arith",
            "maxPromptLength": 8,
            "maxResponseLength": 4,
        },
        "algorithm": {"name": "grpo", "groupSize": 8, "temperature": 1.0},
        "training": {
            "mode": mode,
            "totalSteps": steps,
            "trainBatchSize": 32,
            "miniBatchSize": 16,
            "microBatchSize": 128,
            "learningRate": 5.0e-4,
            "warmupSteps": 5,
            "lrSchedule": "cosine",
            "evalIntervalSteps": 10,
        },
        "trainer": dict(DEMO_TRAINER if trainer is None else trainer),
        "rollout": {"engine": "hf"},
        "gpu": {"vendor": "cpu"},
        "checkpoint": {"intervalSteps": 50},
    }
    if mode == "separate_async":
        spec["async"] = {"stalenessThreshold": 1.0, "parameterSyncStep": 2}
    spec = merge_spec(spec, over)
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}


def main(argv: list[str] | None = None) -> int:
    """``python -m rlkube.devcluster.tiny_task --out DIR [--rljob FILE]``: prepare, write the RLJob."""
    import argparse

    import yaml

    p = argparse.ArgumentParser(description="Prepare the tiny arithmetic task and its RLJob.")
    p.add_argument("--out", type=Path, required=True, help="where the model and data go")
    p.add_argument("--rljob", type=Path, default=None, help="write the RLJob YAML here")
    p.add_argument("--name", default="tiny-arith")
    p.add_argument("--mode", default="sync", choices=["sync", "colocate_async", "separate_async"])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--sft-steps", type=int, default=65)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    task = prepare_tiny_task(args.out, sft_steps=args.sft_steps)
    print(f"tiny task ready in {args.out}: held-out greedy reward after warm start {task.warm_accuracy:.2f}")
    if args.rljob:
        args.rljob.parent.mkdir(parents=True, exist_ok=True)
        args.rljob.write_text(
            yaml.safe_dump(
                tiny_rljob(task, name=args.name, mode=args.mode, steps=args.steps), sort_keys=False
            )
        )
        print(f"RLJob written to {args.rljob}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
