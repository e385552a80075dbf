"""``rlkube-train --rljob FILE``: the entrypoint the operator's RayJob runs (and a laptop's local run).

Reads the RLJob (the mounted ConfigMap in a pod, a local YAML elsewhere) and trains it: ``sync`` with
the hf engine runs in this one process unless ``--ray`` is given; every other combination runs on Ray,
joining ``RAY_ADDRESS`` when set (the RayJob's cluster) or starting a local Ray with the worker-group
resources the operator would render. Everything else comes from the spec.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _default_output(job_name: str) -> Path:
    return Path("outputs") / (job_name or "rljob")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkube-train", description=__doc__.splitlines()[0])
    parser.add_argument("--rljob", required=True, type=Path, help="RLJob YAML (full object or bare spec)")
    parser.add_argument(
        "--output", type=Path, default=None, help="metrics, TensorBoard, curve (default outputs/<name>)"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many more steps")
    parser.add_argument(
        "--ray", action="store_true", help="use Ray even for sync + hf (actors per worker group)"
    )
    parser.add_argument("--no-ray", action="store_true", help="run every mode in this process (no Ray)")
    parser.add_argument(
        "--device", default=None, help="torch device of the trainer (default: cuda if present)"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    import torch

    torch.set_num_threads(int(os.environ.get("RLKUBE_TORCH_THREADS", "1")))
    from rlkube.api import load_resolved

    job = load_resolved(args.rljob)  # the operator's file as is; a user's own file resolved once here
    out = args.output or _default_output(job.name)
    spec = job.spec
    use_ray = args.ray or ((spec.training.mode != "sync" or spec.rollout.engine != "hf") and not args.no_ray)
    if use_ray:
        from rlkube.runtime.trainer.ray_runtime import run_on_ray

        result = run_on_ray(job, out, max_steps=args.max_steps, device=args.device)
    else:
        from rlkube.runtime.trainer.local import run_local

        result = run_local(job, out, max_steps=args.max_steps, device=args.device)
    print(
        f"rlkube-train: {result.final_step}/{spec.training.total_steps} steps; "
        f"metrics {result.metrics_path}; "
        f"reward curve {result.curve_path}; TensorBoard {result.output_dir / 'tensorboard'}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
