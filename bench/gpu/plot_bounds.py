"""Plot each GPU figure as a fraction of its bound, with the issue's targets.

    python bench/gpu/plot_bounds.py [bench/results]     # -> bench/results/gpu-bounds.png

Reads ``rollout-gpu.json`` (decode: ``fraction_of_bound`` per model and shape) and
``trainer-gpu.json`` (``mfu_update`` per model and job); a file the folder lacks (a device run of
one bench) comes from ``bench/results/``, the committed figures, and the plot then says so: each
panel names the card its figures came from, since a fraction measured on one card does not stand
for another's. Runs anywhere matplotlib does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DECODE_TARGETS = {
    ("0.5b", "b64"): 0.30,
    ("1.5b", "b64"): 0.40,
    ("0.5b", "b512"): 0.50,
    ("1.5b", "b512"): 0.50,
}
MFU_TARGETS = {("0.5b", "today"): 0.30, ("1.5b", "today"): 0.40}
RESULTS = Path(__file__).resolve().parents[1] / "results"


def load(folder: Path, name: str) -> tuple[dict, str]:
    """``folder/name``, else the committed ``bench/results/name``; with where it came from."""
    if (folder / name).exists():
        return json.loads((folder / name).read_text()), "this folder"
    return json.loads((RESULTS / name).read_text()), f"committed {name}"


def card(report: dict) -> str:
    """The card's short name (``NVIDIA H100 80GB HBM3`` -> ``H100 80GB HBM3``)."""
    return str(report["device"]).removeprefix("NVIDIA ")


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(argv[0]) if argv else RESULTS
    (rollout, rollout_from), (trainer, trainer_from) = (
        load(folder, "rollout-gpu.json"),
        load(folder, "trainer-gpu.json"),
    )
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})

    labels, vals, targets = [], [], []
    for r in rollout["results"]:
        for shape in ("b64", "b512", "rl"):
            if "fraction_of_bound" in r.get(shape, {}):
                labels.append(f"{r['size']}\n{shape} ({r[shape]['batch']})")
                vals.append(r[shape]["fraction_of_bound"])
                targets.append(DECODE_TARGETS.get((r["size"], shape)))
    xs = range(len(vals))
    ax1.bar(xs, [100 * v for v in vals], color="tab:blue")
    for x, t in zip(xs, targets, strict=True):
        if t is not None:
            ax1.hlines(100 * t, x - 0.4, x + 0.4, colors="tab:red", linestyles="dashed")
    for x, v in zip(xs, vals, strict=True):
        ax1.text(x, 100 * v + 1, f"{100 * v:.1f}%", ha="center", fontsize=8)
    ax1.set_xticks(list(xs), labels, fontsize=8)
    ax1.set_ylabel("% of min(memory, compute) bound")
    ax1.set_ylim(0, 100)
    read, gemm = rollout["read_bandwidth_gbs"] / 1e3, rollout["gemm_tflops"]
    ax1.set_title(
        f"hf engine decode, {card(rollout)} ({rollout_from}; read {read:.2f} TB/s, GEMM {gemm:.0f} TFLOP/s)",
        fontsize=8,
    )

    labels, vals, targets = [], [], []
    for e in trainer["results"]:
        for job in ("today", "rl"):
            if "mfu_update" in e.get(job, {}):
                labels.append(f"{e['size']}\n{job}")
                vals.append(e[job]["mfu_update"])
                targets.append(MFU_TARGETS.get((e["size"], job)))
    xs = range(len(vals))
    ax2.bar(xs, [100 * v for v in vals], color="tab:green")
    for x, t in zip(xs, targets, strict=True):
        if t is not None:
            ax2.hlines(100 * t, x - 0.4, x + 0.4, colors="tab:red", linestyles="dashed")
    for x, v in zip(xs, vals, strict=True):
        ax2.text(x, 100 * v + 1, f"{100 * v:.1f}%", ha="center", fontsize=8)
    ax2.set_xticks(list(xs), labels, fontsize=8)
    ax2.set_ylabel("update MFU, % of measured GEMM rate")
    ax2.set_ylim(0, 100)
    ax2.set_title(
        f"GRPO update, {card(trainer)} ({trainer_from}; GEMM {trainer['gemm_tflops']:.0f} TFLOP/s)",
        fontsize=8,
    )
    devices = rollout["device"] if rollout["device"] == trainer["device"] else "two cards (see each panel)"
    fig.suptitle(
        f"{devices}, torch {rollout['torch']}: fractions of the honest bound; dashed: targets", fontsize=10
    )
    fig.tight_layout()
    out = folder / "gpu-bounds.png"
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
