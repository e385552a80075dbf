"""The run loop shared by every mode: resume, step, metrics, status, eval, checkpoints, the curve.

A *driver* (``modes.py``) produces one training step at a time and owns how rollout and training
overlap; this loop owns everything around the steps, so resume semantics are identical in all modes:
the metrics JSONL holds exactly one row per completed step, and a resumed run continues at the step
after the last checkpoint with the sampler, RNG, weights and replay buffer of that moment.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlkube.runtime.heap import freeze_warm_heap, thaw_heap
from rlkube.runtime.metrics import (
    JsonlSink,
    MetricsLogger,
    StatusPusher,
    TensorBoardSink,
    TerminalSink,
    progress_from_metrics,
    read_jsonl,
)
from rlkube.runtime.trainer.checkpoint import load_latest, save_checkpoint
from rlkube.runtime.trainer.core import Trainer

log = logging.getLogger(__name__)


class Driver(Protocol):
    """One mode: ``step()`` runs one training step and returns its metrics."""

    def step(self) -> dict[str, float]: ...

    def evaluate(self) -> dict[str, float]: ...

    def replay_state(self) -> list[dict[str, Any]]: ...

    def load_replay(self, samples: list[dict[str, Any]]) -> None: ...

    def after_resume(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class RunResult:
    output_dir: Path
    steps_run: int
    final_step: int
    metrics_path: Path
    curve_path: Path | None
    resumed_from: int | None


def flops_per_token(num_params: int) -> float:
    """Forward FLOPs per token of a dense decoder (2N; attention's share is small at these lengths)."""
    return 2.0 * num_params


def add_perf(trainer: Trainer, m: dict[str, float], num_gpus: int, peak: float | None) -> None:
    """Throughput and MFU of a step from its token counts and timings."""
    step_s = m.get("timing_s/step", 0.0)
    tokens = m.get("batch/response_tokens", 0.0) + m.get("batch/prompt_tokens", 0.0)
    if step_s > 0:
        m["perf/tokens_per_s"] = tokens / step_s
        m["perf/tokens_per_s_per_gpu"] = tokens / step_s / max(num_gpus, 1)
        m["perf/response_tokens_per_s"] = m.get("batch/response_tokens", 0.0) / step_s
    if peak and step_s > 0:
        f = flops_per_token(trainer.actor.num_params)
        epochs = trainer.spec.algorithm.ppo_epochs
        passes = 1.0 + 3.0 * epochs + (1.0 if trainer.ref is not None else 0.0)  # old-logp, fwd+bwd, ref
        gen = m.get("batch/response_tokens", 0.0) * f
        m["perf/mfu"] = (tokens * f * passes + gen) / (step_s * peak * max(num_gpus, 1))


def write_reward_curve(metrics_path: Path, out: Path, title: str = "") -> Path | None:
    """reward/mean (train) and eval/reward_mean against step, as a PNG."""
    rows = read_jsonl(metrics_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    tr = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    ev = [(r["step"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    if tr:
        ax.plot(*zip(*tr, strict=True), label="train reward (sampled)")
    if ev:
        ax.plot(*zip(*ev, strict=True), "o-", label="held-out reward (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def run_loop(
    trainer: Trainer,
    driver: Driver,
    output_dir: str | Path,
    *,
    max_steps: int | None = None,
    num_gpus: int = 0,
    checkpoint_dir: str | Path | None = None,
    tensorboard: bool = True,
    pusher: StatusPusher | None = None,
    freeze_heap: bool = False,
) -> RunResult:
    """Run to ``training.totalSteps`` (or ``max_steps`` more steps), resuming from the last checkpoint.

    ``freeze_heap``: after the first step (models, optimiser state and compiled code all built),
    move the process's live objects out of the garbage collector's walks (``rlkube.runtime.heap``),
    and give them back when the loop ends. A trainer rank's process asks for it; a process whose
    engine freezes already (one process, no Ray) need not.
    """
    spec = trainer.spec
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir else out / "checkpoints"
    metrics_path = out / "metrics.jsonl"
    resumed_from = None
    loaded = load_latest(ckpt_dir, load_shards=trainer.load_models)
    if loaded is not None:
        state, replay = loaded
        trainer.load_state_dict(state)
        driver.load_replay(replay)
        resumed_from = trainer.step
        _truncate_metrics(metrics_path, trainer.step)
        log.info(
            "resumed from checkpoint at step %d (version %d) in %s", trainer.step, trainer.version, ckpt_dir
        )
    driver.after_resume()
    total = spec.training.total_steps
    stop = total if max_steps is None else min(total, trainer.step + max_steps)
    try:
        from rlkube.runtime.platform import current_platform

        peak = current_platform().peak_flops() if num_gpus else None
    except Exception:
        peak = None
    sinks: list[Any] = [JsonlSink(metrics_path), TerminalSink(total, trainer.step)]
    if tensorboard:
        try:
            # On a resume the event files are rebuilt from metrics.jsonl (already cut back to the
            # checkpoint), so steps that run again are not plotted twice.
            history = read_jsonl(metrics_path) if resumed_from is not None and metrics_path.exists() else None
            sinks.append(TensorBoardSink(out / "tensorboard", history=history))
        except Exception as e:
            log.warning("TensorBoard disabled: %s", e)
    logger = MetricsLogger(sinks)
    pusher = pusher if pusher is not None else StatusPusher()
    interval = spec.checkpoint.interval_steps
    eval_every = spec.training.eval_interval_steps
    last_ckpt = resumed_from
    steps_run = 0
    froze = False
    try:
        if trainer.step == 0 and eval_every and trainer.val_records and resumed_from is None:
            m0 = driver.evaluate()
            logger.log(0, {**m0, "policy_version": float(trainer.version)})
        while trainer.step < stop:
            t0 = time.perf_counter()
            m = driver.step()
            trainer.step += 1
            steps_run += 1
            m.setdefault("timing_s/step", time.perf_counter() - t0)
            m["policy_version"] = float(trainer.version)
            add_perf(trainer, m, num_gpus, peak)
            if (
                eval_every
                and trainer.val_records
                and (trainer.step % eval_every == 0 or trainer.step == total)
            ):
                m.update(driver.evaluate())
            if (interval and trainer.step % interval == 0) or trainer.step == total:
                save_checkpoint(
                    ckpt_dir,
                    trainer.step,
                    trainer.state_dict(),
                    driver.replay_state(),
                    keep=spec.checkpoint.keep,
                    write_shards=trainer.save_models,
                )
                last_ckpt = trainer.step
            m.update(trainer.counters())
            clean = logger.log(trainer.step, m)
            pusher.push(
                progress_from_metrics(trainer.step, total, clean, last_ckpt), force=trainer.step == total
            )
            if freeze_heap and steps_run == 1:
                froze = freeze_warm_heap()
    finally:
        if froze:
            thaw_heap()
        logger.close()
        driver.close()
    curve = None
    try:
        curve = write_reward_curve(
            metrics_path,
            out / "reward_curve.png",
            f"{trainer.job.name or 'rljob'} ({spec.algorithm.name}, {spec.training.mode})",
        )
    except Exception as e:
        log.warning("reward curve not written: %s", e)
    return RunResult(out, steps_run, trainer.step, metrics_path, curve, resumed_from)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows past the checkpoint: those steps are re-run, and must appear once."""
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if _row_step(line) is not None and (_row_step(line) or 0) <= step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def _row_step(line: str) -> int | None:
    import json

    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
