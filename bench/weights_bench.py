"""Weight-sync benchmark: full vs delta for Qwen2.5-0.5B- and 7B-shaped models (random init).

    make bench-weights                                   # CPU, JSON in bench/results/weights-cpu.json
    python bench/weights_bench.py --device cuda          # GPU: D2D and D2H2D paths, weights-<gpu>.json

Each bucketed sync is timed end to end: packing buckets (diff, nonzero, gather on the params' device),
moving them (in-process; GPU->GPU; or GPU->pinned host->GPU), verifying every checksum and
applying them atomically on the receiver. ``full_direct`` is the in-process full sync the
trainer uses when the engine shares its process: validate every name and shape, then one
grouped ``_foreach_copy_`` (no packing, no checksums: nothing crosses a wire). Achieved
bandwidth (model bytes / seconds) is compared with a copy bandwidth measured in the same run.
Runs in one process without Ray or vLLM, so it also runs where only torch is installed (the
H200 box); rlkube need not be installed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform as pyplatform
import resource
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _import_weights() -> Any:
    """rlkube.runtime.weights, from the installed package or straight from this checkout."""
    try:
        import rlkube.runtime.weights as w

        return w
    except ImportError:
        pkg = types.ModuleType("rlkube")
        pkg.__path__ = []
        sys.modules["rlkube"] = pkg
        spec = importlib.util.spec_from_file_location(
            "rlkube.runtime",
            ROOT / "runtime" / "__init__.py",
            submodule_search_locations=[str(ROOT / "runtime")],
        )
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["rlkube.runtime"] = mod
        spec.loader.exec_module(mod)
        import rlkube.runtime.weights as w

        return w


W = _import_weights()

# Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings).
MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"h": 896, "i": 4864, "layers": 24, "heads": 14, "kv": 2, "vocab": 151936, "tied": True},
    "qwen2.5-7b": {"h": 3584, "i": 18944, "layers": 28, "heads": 28, "kv": 4, "vocab": 152064, "tied": False},
}


def param_groups(cfg: dict[str, Any], by_layer: bool) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Parameter shapes, as one group or one group per layer (to bound host memory)."""
    h, i, kvd = cfg["h"], cfg["i"], cfg["kv"] * (cfg["h"] // cfg["heads"])
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[("model.embed_tokens.weight", (cfg["vocab"], h))]]
    for n in range(cfg["layers"]):
        p = f"model.layers.{n}."
        groups.append(
            [
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.q_proj.bias", (h,)),
                (p + "self_attn.k_proj.weight", (kvd, h)),
                (p + "self_attn.k_proj.bias", (kvd,)),
                (p + "self_attn.v_proj.weight", (kvd, h)),
                (p + "self_attn.v_proj.bias", (kvd,)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,)),
            ]
        )
    last: list[tuple[str, tuple[int, ...]]] = [("model.norm.weight", (h,))]
    if not cfg["tied"]:
        last.append(("lm_head.weight", (cfg["vocab"], h)))
    groups.append(last)
    if not by_layer:
        return [[s for g in groups for s in g]]
    return groups


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes copied per second by one large copy_ on `device` (each byte read once, written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return nbytes / best


def host_device_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Pinned host<->device copy bandwidth (the D2H2D path's bound)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (a, b) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        a.copy_(b, non_blocking=True)
        sync_device(device)
        t0 = time.perf_counter()
        for _ in range(3):
            a.copy_(b, non_blocking=True)
        sync_device(device)
        out[name] = 3 * nbytes / (time.perf_counter() - t0)
    return out


class Staging:
    """GPU -> pinned host -> GPU transport of bucket payloads, reusing one pinned buffer."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        self.device = device

    def move(self, b: Any) -> Any:
        n = b.nbytes
        self.host[:n].copy_(b.payload, non_blocking=True)
        dst = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst.copy_(self.host[:n], non_blocking=True)  # stream-ordered after the D2H copy
        import dataclasses

        return dataclasses.replace(b, payload=dst)


def init_params(
    shapes: list[tuple[str, tuple[int, ...]]], device: torch.device, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {
        n: torch.empty(s, dtype=dtype, device=device).uniform_(-0.02, 0.02, generator=g) for n, s in shapes
    }


def perturb(params: dict[str, torch.Tensor], fraction: float, seed: int) -> None:
    """Set about `fraction` of each tensor's elements (random positions) to new values in [1, 2)."""
    for i, t in enumerate(params.values()):
        flat = t.view(-1)
        k = max(1, int(flat.numel() * fraction))
        g = torch.Generator(device=flat.device).manual_seed(seed * 1000 + i)
        pos = torch.randint(0, flat.numel(), (k,), device=flat.device, generator=g)
        flat[pos] = (torch.rand(k, device=flat.device, generator=g) + 1.0).to(flat.dtype)


def run_sync(
    stream: Iterator[Any], receiver: Any, staging: Staging | None, device: torch.device
) -> tuple[float, int, set[str]]:
    """Pull buckets through the transport, apply atomically; (seconds, buckets, changed names)."""
    t0 = time.perf_counter()
    buckets = [staging.move(b) if staging else b for b in stream]
    changed = receiver.apply(buckets)
    sync_device(device)
    return time.perf_counter() - t0, len(buckets), changed


def bench_model(
    model: str,
    device: torch.device,
    fractions: list[float],
    path: str,
    snapshot: str,
    bucket_mb: float,
    by_layer: bool,
) -> dict[str, Any]:
    """Full sync then one delta per fraction, summed over parameter groups."""
    cfg = MODELS[model]
    groups = param_groups(cfg, by_layer)
    staging = Staging(int(bucket_mb * 2**20), device) if path == "d2h2d" else None
    # "seed": the first sync (dense; allocates snapshots and pinned memory), "full": a steady-state one.
    # "full_nosnap": a full sync by a sender that keeps no snapshots (full-sync-only deployments).
    # "full_direct": no buckets at all, one validated grouped copy (trainer and engine in one process).
    totals: dict[str, dict[str, float]] = {"seed": {}, "full": {}, "full_nosnap": {}}
    totals.update({f"delta_{f}": {} for f in fractions})
    elements = 0
    identical = True
    for gi, shapes in enumerate(groups):
        trainer = init_params(shapes, device, torch.bfloat16, seed=gi)
        engine = {n: torch.zeros_like(t) for n, t in trainer.items()}
        receiver = W.WeightReceiver(engine)
        sender = W.WeightSender(bucket_megabytes=bucket_mb, snapshot_device=snapshot)
        elements += sum(t.numel() for t in trainer.values())
        nosnap = W.WeightSender(bucket_megabytes=bucket_mb, keep_snapshots=False)
        runs: list[tuple[str, float | None]] = [("seed", None), ("full", None)]
        runs += [(f"delta_{f}", f) for f in fractions]
        runs.append(("full_nosnap", None))  # last: the receiver's version then moves past `sender`'s
        for step, (key, fraction) in enumerate(runs):
            if fraction is not None:
                perturb(trainer, fraction, seed=gi * 10 + step)
                sync_device(device)
                stream = sender.delta(trainer.items(), step)
            elif key == "full_nosnap":
                stream = nosnap.full(trainer.items(), step)
            else:
                stream = sender.full(trainer.items(), step)
            seconds, nb, _ = run_sync(stream, receiver, staging, device)
            st = (nosnap if key == "full_nosnap" else sender).last_stats
            acc = totals[key]
            acc["seconds"] = acc.get("seconds", 0.0) + seconds
            acc["payload_mb"] = acc.get("payload_mb", 0.0) + st.payload_mb
            acc["changed_elements"] = acc.get("changed_elements", 0) + st.changed_elements
            acc["buckets"] = acc.get("buckets", 0) + nb
            identical &= all(
                torch.equal(trainer[n].view(torch.int16), engine[n].view(torch.int16)) for n in trainer
            )
        if path != "d2h2d":  # same process, same device: the trainer's bucket-free full sync
            # ``full_direct``: a held copier, as the hf engine keeps one (the warm-up makes the plan,
            # the timed sync reuses it); ``full_direct_replan``: a one-shot copy that validates again.
            copier = W.DirectCopier()
            copier(engine, trainer.items(), len(runs), require_all=True)  # warm-up + plan
            for key, copy in (("full_direct", copier), ("full_direct_replan", W.copy_direct)):
                perturb(trainer, 0.01, seed=gi * 10 + 99)
                sync_device(device)
                st = copy(engine, trainer.items(), len(runs), require_all=True)
                acc = totals.setdefault(key, {})
                acc["seconds"] = acc.get("seconds", 0.0) + st.seconds
                acc["payload_mb"] = acc.get("payload_mb", 0.0) + st.payload_mb
                moved = sum(t.numel() for t in trainer.values())
                acc["changed_elements"] = acc.get("changed_elements", 0) + moved
                acc["buckets"] = 0
                identical &= all(
                    torch.equal(trainer[n].view(torch.int16), engine[n].view(torch.int16)) for n in trainer
                )
            assert copier.replans == 1, "the held copier re-validated tensors that had not moved"
        del trainer, engine, receiver, sender, nosnap
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model_mb = elements * 2 / 1e6
    out: dict[str, Any] = {"model": model, "path": path, "snapshot": snapshot, "elements": elements}
    out["model_mb_bf16"] = model_mb
    out["groups"] = len(groups)
    out["bit_identical"] = identical
    out["syncs"] = {}
    for key, acc in totals.items():
        r = {
            "seconds": round(acc["seconds"], 4),
            "payload_mb": round(acc["payload_mb"], 3),
            "changed_ratio": acc["changed_elements"] / elements,
            "buckets": int(acc["buckets"]),
            "model_gb_per_s": model_mb / 1e3 / acc["seconds"],
            "payload_gb_per_s": acc["payload_mb"] / 1e3 / acc["seconds"],
        }
        if key.startswith("delta"):
            full_mb = totals["full"]["payload_mb"]
            changed = acc["changed_elements"] / elements
            index_mb = acc["changed_elements"] * 4 / 1e6
            r["target_payload_mb"] = 1.5 * changed * full_mb + index_mb
            r["payload_within_target"] = acc["payload_mb"] <= r["target_payload_mb"]
            r["payload_vs_full"] = acc["payload_mb"] / full_mb
        out["syncs"][key] = r
    return out


def direct_host_overhead(model: str, device: torch.device, reps: int = 200) -> dict[str, Any]:
    """Host time of a direct full sync alone: the model's names with one-element tensors.

    What a small model pays on a fast GPU, where the copy itself is a fraction of a millisecond:
    a one-shot ``copy_direct`` validates and groups every tensor each sync, a held
    ``DirectCopier`` only fingerprints both sides and launches the grouped copies.
    """
    names = [n for g in param_groups(MODELS[model], by_layer=False) for n, _ in g]
    src = {n: torch.ones(1, device=device, dtype=torch.bfloat16) for n in names}
    dst = {n: torch.zeros(1, device=device, dtype=torch.bfloat16) for n in names}
    out: dict[str, Any] = {"tensors": len(names)}
    copier = W.DirectCopier()
    for key, copy in (("one_shot_ms", W.copy_direct), ("held_copier_ms", copier)):
        copy(dst, src.items(), 0)
        best = float("inf")
        for _ in range(5):  # best of 5 rounds: the least disturbed by other work on the machine
            t0 = time.perf_counter()
            for _ in range(reps):
                copy(dst, src.items(), 0)
            best = min(best, (time.perf_counter() - t0) / reps * 1e3)
        out[key] = best
    out["held_vs_one_shot"] = out["held_copier_ms"] / out["one_shot_ms"]
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the GPU box may lack it: the JSON is the result
        print("matplotlib not installed: no plot")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    labels, secs, mbs = [], [], []
    for r in runs:
        for key, s in r["syncs"].items():
            labels.append(f"{r['model'].split('-')[1]} {r['path']}/{r['snapshot']}\n{key}")
            secs.append(s["seconds"])
            mbs.append(s["payload_mb"])
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(labels)), 8))
    axes[0].bar(range(len(labels)), secs, color="tab:blue")
    axes[0].set_ylabel("seconds per sync")
    axes[0].set_yscale("log")
    axes[1].bar(range(len(labels)), mbs, color="tab:orange")
    axes[1].set_ylabel("MB shipped")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    fig.suptitle(f"weight sync, full vs delta ({results['device']['name']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (ROCm GPUs are 'cuda' too)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.01, 0.03])
    ap.add_argument("--bucket-mb", type=float, default=None, help="default: 256 on CPU, 1024 on GPU")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: all on GPU, 2 on CPU)"
    )
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(a.threads or (2 if device.type == "cpu" else torch.get_num_threads()))
    bucket_mb = a.bucket_mb or (256.0 if device.type == "cpu" else 1024.0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else pyplatform.processor() or "cpu"
    tag = "cpu" if device.type == "cpu" else name.split()[-1].lower().replace("/", "-")
    out = a.out or ROOT / "bench" / "results" / f"weights-{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    dev_info: dict[str, Any] = {"type": device.type, "name": name, "torch": torch.__version__}
    dev_info["copy_gb_per_s"] = copy_bandwidth(device) / 1e9
    if device.type == "cuda":
        dev_info.update({f"{k}_gb_per_s": v / 1e9 for k, v in host_device_bandwidth(device).items()})
        paths = [("d2d", "device"), ("d2d", "cpu"), ("d2h2d", "cpu")]
    else:
        paths = [("inproc", "cpu")]
    print(json.dumps(dev_info), flush=True)
    runs = []
    for model in a.models:
        by_layer = device.type == "cpu" and model == "qwen2.5-7b"  # 3 copies of 15 GB do not fit 24 GB
        for path, snap in paths:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            r = bench_model(model, device, a.fractions, path, snap, bucket_mb, by_layer)
            r["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
            if device.type == "cuda":
                r["peak_device_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            for s in r["syncs"].values():
                s["ratio_to_copy_bw"] = s["model_gb_per_s"] / dev_info["copy_gb_per_s"]
            print(json.dumps(r), flush=True)
            runs.append(r)
    overhead = {m: direct_host_overhead(m, device) for m in a.models}
    print(json.dumps({"direct_host_overhead": overhead}), flush=True)
    results = {
        "device": dev_info,
        "bucket_mb": bucket_mb,
        "dtype": "bfloat16",
        "method": "random-init Qwen2.5 shapes; full sync then one delta per fraction from the full state; "
        "seconds are end to end (pack, transport, verify all checksums, atomic apply), summed over "
        "parameter groups; model_gb_per_s = bf16 model bytes / seconds; copy_gb_per_s = bytes per second "
        "of one large same-device copy_",
        "runs": runs,
        "direct_host_overhead": overhead,
    }
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
