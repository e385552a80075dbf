"""One decode step of the hf engine's ``StaticDecoder`` per attention configuration (A/B on one GPU).

Where ``rollout_gpu.py`` times whole ``generate`` calls, this times the captured decode step alone
(graph replays from a fixed context), so a choice the step makes rests on a measurement: here the
attention kernel's split (positions per program; ``direct`` is one program per row and KV head and
no combine kernel). Random-init Qwen2 with Qwen2.5-0.5B / 1.5B shapes, bf16.

    python bench/gpu/decode_step_gpu.py                       # GPU: 0.5b and 1.5b, 64 and 512 rows
    python bench/gpu/decode_step_gpu.py --sizes 0.5b --rows 64 --context 192

Writes JSON to stdout and to ``$OUT/decode-step-gpu.json`` when ``$OUT`` is set; each entry has the
step time (median of ``--repeats`` timings of ``--steps`` replays), its fraction of the step's
read-bandwidth bound (weights once, the KV of every row over its context, the logits) and the
ratio to the first configuration of the same shape.
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

_spec = importlib.util.spec_from_file_location("rlkube_bench_common", Path(__file__).with_name("_common.py"))
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
common.import_rlkube()

import torch  # noqa: E402

from rlkube.runtime.models.roofline import model_cost  # noqa: E402
from rlkube.runtime.models.tiny import make_qwen2_like  # noqa: E402
from rlkube.runtime.rollout.hf_decode import StaticDecoder  # noqa: E402

# name -> attention split: positions per program (None: the default policy; "direct": one program
# per row and KV head, no combine kernel)
CONFIGS: dict[str, int | str | None] = {
    "default": None,
    "direct": "direct",
    "split128": 128,
    "split256": 256,
}


def time_step(dec: StaticDecoder, rows: int, context: int, steps: int, repeats: int) -> float:
    """Median seconds per replayed step, every row at ``context`` positions when each timing starts."""
    s = dec.state
    s.pos[:rows] = context
    s.running[:rows] = True
    s.n_gen[:rows] = 0
    s.max_new[:rows] = dec.T
    s.temperature[:rows] = 1.0
    snap = {k: v.clone() for k, v in vars(s).items()}
    dec.decode(rows)  # capture (and compile) outside the timings
    out = []
    for _ in range(repeats):
        for k, v in snap.items():
            getattr(s, k).copy_(v)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            dec.decode(rows)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / steps)
    return statistics.median(out)


def configure(dec: StaticDecoder, name: str, default_split: Any) -> None:
    split = CONFIGS[name]
    dec.drop_graphs()
    att = dec._attention
    if split is None:
        att.split_for = default_split
    else:
        fixed = att.max_seq if split == "direct" else int(split)
        att.split_for = lambda rows, fixed=fixed: max(fixed, default_split(rows))


def bench(
    size: str, rows: int, context: int, args: argparse.Namespace, read_bps: float
) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    model = make_qwen2_like(size, dtype=torch.bfloat16, device="cpu").to(dev)  # CPU init: no CUDA RNG
    cost = model_cost(model.config, dtype_bytes=2)
    step_bytes = cost.weight_bytes_per_step + rows * (context + 1) * cost.kv_bytes_per_token
    step_bytes += rows * model.config.vocab_size * 2  # the logits, written once and read by the sampler
    dec = StaticDecoder(
        model, num_slots=rows, max_seq_len=context + args.steps + 8, max_new_tokens=args.steps + 4,
        compile_step="auto", kernels_setting=True,
    )  # fmt: skip
    default_split = dec._attention.split_for
    res = []
    base = None
    for name in args.configs.split(","):
        configure(dec, name, default_split)
        try:
            t = time_step(dec, rows, context, args.steps, args.repeats)
        except Exception as exc:
            res.append({"size": size, "rows": rows, "config": name, "error": f"{type(exc).__name__}: {exc}"})
            continue
        base = base or t
        res.append({
            "size": size, "rows": rows, "context": context, "config": name,
            "step_ms": 1e3 * t, "bound_ms": 1e3 * step_bytes / read_bps,
            "fraction_of_read_bound": step_bytes / read_bps / t, "speedup_vs_first": base / t,
            "split": dec._attention.split_for(rows),
        })  # fmt: skip
        print(json.dumps(res[-1]), flush=True)
    del dec, model
    torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", default="0.5b,1.5b")
    ap.add_argument("--rows", default="64,512")
    ap.add_argument("--context", type=int, default=192, help="positions in the KV cache of every row")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    ceil = common.ceilings(torch.device("cuda"), False)
    report: dict[str, Any] = {
        "benchmark": "decode-step-gpu",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "read_bandwidth_gbs": ceil["read_bandwidth_gbs"],
        "args": vars(args),
        "results": [],
    }
    for size in args.sizes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            report["results"] += bench(size, rows, args.context, args, ceil["read_bandwidth_gbs"] * 1e9)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "decode-step-gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['size']:>5} rows {r['rows']:>4} {r['config']:<16} {r['error']}")
        else:
            print(
                f"{r['size']:>5} rows {r['rows']:>4} {r['config']:<16} {r['step_ms']:7.3f} ms "
                f"{100 * r['fraction_of_read_bound']:5.1f}% of read bound  x{r['speedup_vs_first']:.2f}"
                f"  split {r['split']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
