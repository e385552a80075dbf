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

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbose: bool = False) -> None:
    """INFO lines (resume, checkpoints, warnings) on stderr, in this process and in Ray actors."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT)
    logging.getLogger().setLevel(logging.DEBUG if verbose else logging.INFO)


OUTPUT_DIR_ENV = "RLKUBE_OUTPUT_DIR"


def _default_output(job_name: str) -> Path:
    """`$RLKUBE_OUTPUT_DIR/<name>` (in a pod: a mounted volume the results outlive it on), else
    `outputs/<name>` under the working directory."""
    return Path(os.environ.get(OUTPUT_DIR_ENV) or "outputs") / (job_name or "rljob")


def user_error_line(exc: BaseException, rljob: Path) -> str | None:
    """One line for a mistake the user can fix (the spec, a file, their reward), else None (a crash)."""
    import yaml
    from pydantic import ValidationError

    from rlkube.api import InvalidRLJob
    from rlkube.runtime.errors import find_user_error

    if isinstance(exc, FileNotFoundError) and Path(str(exc.filename or "")) == rljob:
        return f"--rljob {rljob}: no such file"
    if isinstance(exc, IsADirectoryError | PermissionError) and Path(str(exc.filename or "")) == rljob:
        return f"--rljob {rljob}: {exc.strerror}"
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        return f"{rljob}{where}: not valid YAML ({exc.problem or exc.context})"
    if isinstance(exc, yaml.YAMLError):
        return f"{rljob}: not valid YAML ({exc})"
    if isinstance(exc, InvalidRLJob):
        return f"{rljob}: " + "; ".join(str(e) for e in exc.errors)
    if isinstance(exc, ValidationError):
        errs = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return f"{rljob}: " + "; ".join(errs)
    if isinstance(exc, ValueError) and str(exc).startswith(str(rljob)):
        return str(exc)  # load_rljob's own file-level messages (no document, wrong kind)
    found = find_user_error(exc)
    return None if found is None else str(found)


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
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of a user error (bad spec, file, reward)"
    )
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    try:
        return _run(args)
    except Exception as exc:
        line = user_error_line(exc, args.rljob)
        if line is None or args.debug:
            raise
        print(f"rlkube-train: error: {line}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
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
