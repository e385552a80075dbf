"""The trainer core every mode driver reuses: prompts -> requests, completions -> scored samples,
samples -> advantages -> PPO updates, weights -> rollout, and its full state for checkpoints.

It never talks to a concrete engine: drivers hand it completions and get buckets back, so the same
code runs in one process (sync, hf engine) and inside a Ray trainer actor (all three modes).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkube.api import RLJob
from rlkube.api.algorithms import CRITIC_ESTIMATORS
from rlkube.runtime.algos import (
    compute_advantages,
    kl_in_reward,
    kl_penalty,
    masked_mean,
    overlong_penalty,
    rollout_correction,
    scores_to_token_rewards,
)
from rlkube.runtime.data import PromptSampler, load_records
from rlkube.runtime.data.records import Record
from rlkube.runtime.errors import NonFiniteRewardError, UserError
from rlkube.runtime.rewards import get_reward_fn
from rlkube.runtime.rollout.base import Completion, RolloutRequest, SamplingParams
from rlkube.runtime.rollout.registry import model_config_overrides
from rlkube.runtime.trainer.actor import (
    CriticWorker,
    LossConfig,
    OptimConfig,
    PolicyWorker,
    needs_old_logprob_pass,
)
from rlkube.runtime.trainer.batch import Batch, Sample, collate

log = logging.getLogger(__name__)


@dataclass
class PromptRef:
    """A prompt in flight: its record and its index in the training stream."""

    record: Record
    index: int
    prompt_ids: list[int]


class Trainer:
    """Algorithm state of one RLJob: actor (+ ref, critic), sampler, reward, weight version."""

    def __init__(self, job: RLJob, *, device: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.job = job
        spec = self.spec = job.spec
        torch.manual_seed(spec.training.seed)
        random.seed(spec.training.seed)
        check_model_dir("model.path", spec.model.path)
        tok_path = spec.model.tokenizer_path or spec.model.path
        if tok_path != spec.model.path:
            check_model_dir("model.tokenizerPath", tok_path, need="tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        self.pad_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        self.eos_id = int(self.tokenizer.eos_token_id)
        d = spec.data
        self.train_records = load_data("data.train", d.train, d.prompt_key, d.answer_key)
        self.val_records = (
            load_data("data.validation", d.validation, d.prompt_key, d.answer_key) if d.validation else []
        )
        if self.val_records:
            fits = [r for r in self.val_records if len(self.encode(r, cut=False)) <= d.max_prompt_length]
            if len(fits) < len(self.val_records):
                log.warning(
                    "data.validation: %d of %d prompts are longer than data.maxPromptLength (%d tokens) "
                    "and are left out of evaluation",
                    len(self.val_records) - len(fits),
                    len(self.val_records),
                    d.max_prompt_length,
                )
            self.val_records = fits
        self.sampler = PromptSampler(self.train_records, 1, seed=d.seed, shuffle=d.shuffle)
        self.prompts_drawn = 0
        self.prompts_too_long = 0  # skipped for exceeding data.maxPromptLength (never cut)
        self.nonfinite_rewards = 0  # samples skipped for a NaN/inf reward (data.nonFiniteReward: skip)
        # Run-long counts the mode drivers keep (dropped groups, aborts), checkpointed with the rest.
        self.totals: Counter[str] = Counter()
        self.reward_fn = get_reward_fn(d.reward)
        overrides = model_config_overrides(spec)
        a, t = spec.algorithm, spec.training
        self.loss_cfg = LossConfig(
            clip_low=a.clip_ratio_low,
            clip_high=a.clip_ratio_high,
            clip_c=a.clip_ratio_c if a.clip_ratio_c > 1.0 else None,
            policy_loss=a.effective_policy_loss,
            agg_mode=a.effective_loss_aggregation,
            # verl pads every response to data.maxResponseLength, so that is its default Dr. GRPO H;
            # batches here are padded to their longest response only: pass H explicitly.
            norm_constant=float(d.max_response_length),
            entropy_coeff=a.entropy_coeff,
            use_kl_loss=a.kl.use_kl_loss,
            kl_loss_coef=a.kl.kl_loss_coef,
            kl_loss_type=a.kl.kl_loss_type,
            temperature=a.temperature if a.temperature > 0 else 1.0,
        )
        optim = OptimConfig(
            lr=t.learning_rate,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps,
            total_steps=t.total_steps,
            schedule=t.lr_schedule,
            grad_clip=t.grad_clip,
        )
        bf16 = None if spec.model.dtype == "bfloat16" else False
        mbs = t.micro_batch_size
        self.actor = PolicyWorker(
            spec.model.path,
            optim=optim,
            loss=self.loss_cfg,
            device=device,
            bf16=bf16,
            micro_batch_size=mbs,
            gradient_checkpointing=spec.model.gradient_checkpointing,
            config_overrides=overrides,
        )
        self.use_ref = a.kl.use_kl_loss or a.kl.in_reward
        self.ref = (
            PolicyWorker(
                spec.model.path,
                trainable=False,
                loss=self.loss_cfg,
                device=device,
                bf16=bf16,
                micro_batch_size=mbs,
                config_overrides=overrides,
            )
            if self.use_ref
            else None
        )
        self.critic = (
            CriticWorker(
                spec.model.path,
                optim=OptimConfig(
                    lr=t.critic_learning_rate,
                    weight_decay=t.weight_decay,
                    warmup_steps=t.warmup_steps,
                    total_steps=t.total_steps,
                    schedule=t.lr_schedule,
                    grad_clip=t.grad_clip,
                ),
                loss=self.loss_cfg,
                device=device,
                bf16=bf16,
                micro_batch_size=mbs,
                config_overrides=overrides,
            )
            if a.effective_advantage_estimator in CRITIC_ESTIMATORS
            else None
        )
        from rlkube.runtime.weights import WeightSender

        wire = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        engine_dtype = wire[spec.model.dtype] if self.actor.device.type != "cpu" else torch.float32
        self.sender = WeightSender(bucket_megabytes=spec.weight_sync.bucket_megabytes, dtype=engine_dtype)
        self.step = 0  # completed training steps
        self.version = 0  # weights version the rollout serves after the last sync
        self.rng = random.Random(spec.training.seed)

    # -- prompts and requests ----------------------------------------------------------------
    def encode(self, record: Record, *, cut: bool = True) -> list[int]:
        """Prompt ids: BOS (when the tokenizer has one) + the prompt.

        Prompts longer than ``data.maxPromptLength`` are skipped by ``next_prompts`` (never trained
        on cut); ``cut`` only keeps evaluation of such a prompt within the engine's length limit.
        """
        if record.messages is not None and getattr(self.tokenizer, "chat_template", None):
            ids = list(self.tokenizer.apply_chat_template(record.messages, add_generation_prompt=True))
        else:
            ids = list(self.tokenizer(record.prompt, add_special_tokens=False).input_ids)
            if self.tokenizer.bos_token_id is not None:
                ids = [int(self.tokenizer.bos_token_id), *ids]
        return ids[-self.spec.data.max_prompt_length :] if cut else ids

    def next_prompts(self, n: int) -> list[PromptRef]:
        """The next ``n`` prompts of the resumable stream; over-long ones are skipped and counted."""
        out: list[PromptRef] = []
        limit = self.spec.data.max_prompt_length
        skipped_in_a_row = 0
        while len(out) < n:
            (rec,) = self.sampler.next_batch()
            ids = self.encode(rec, cut=False)
            if len(ids) > limit:
                self.prompts_too_long += 1
                skipped_in_a_row += 1
                if skipped_in_a_row > len(self.train_records):
                    raise UserError(
                        f"data.maxPromptLength: every prompt of data.train ({self.spec.data.train}) is "
                        f"longer than {limit} tokens; raise data.maxPromptLength"
                    )
                continue
            skipped_in_a_row = 0
            out.append(PromptRef(rec, self.prompts_drawn, ids))
            self.prompts_drawn += 1
        return out

    def sampling_params(
        self, *, n: int | None = None, greedy: bool = False, seed: int | None = None
    ) -> SamplingParams:
        a = self.spec.algorithm
        return SamplingParams(
            n=a.group_size if n is None else n,
            temperature=0.0 if greedy else a.temperature,
            top_p=a.top_p if a.top_p > 0 else 1.0,
            max_tokens=self.spec.data.max_response_length,
            stop_token_ids=(self.eos_id,),
            seed=seed,
        )

    def requests(self, prompts: Sequence[PromptRef]) -> list[RolloutRequest]:
        """One request per prompt (``groupSize`` samples), ids carrying the stream index."""
        base = self.spec.training.seed * 1_000_003
        return [
            RolloutRequest(f"p{p.index}", p.prompt_ids, self.sampling_params(seed=base + p.index))
            for p in prompts
        ]

    # -- rewards -----------------------------------------------------------------------------
    def score(self, completions: Sequence[Completion], prompts: dict[str, PromptRef]) -> list[Sample]:
        """Decode, reward and shape completions (overlong penalty) into samples."""
        texts: list[str] = []
        for c in completions:
            ids = [t for t in c.token_ids if t != self.eos_id]
            texts.append(str(self.tokenizer.decode(ids, skip_special_tokens=True)))
        refs = [prompts[c.request_id] for c in completions]
        results = self.reward_fn([r.record.prompt for r in refs], texts, [r.record.answer for r in refs])
        bad = [i for i, r in enumerate(results) if not math.isfinite(float(r.score))]
        if bad:
            completions, results, refs, texts = self._drop_nonfinite(bad, completions, results, refs, texts)
            if not completions:
                return []
        scores = torch.tensor([float(r.score) for r in results], dtype=torch.float32)
        ob = self.spec.algorithm.overlong_buffer
        max_len = self.spec.data.max_response_length
        if ob is not None and ob.enabled:
            lengths = torch.tensor([len(c.token_ids) for c in completions])
            scores = scores + overlong_penalty(lengths, max_len, min(ob.length, max_len), ob.penalty_factor)
        out = []
        for c, res, s, ref in zip(completions, results, scores.tolist(), refs, strict=True):
            out.append(
                Sample(
                    prompt_ids=list(c.prompt_ids),
                    response_ids=list(c.token_ids),
                    group=c.request_id,
                    policy_version=int(c.policy_version),
                    reward=float(res.score),
                    score=float(s),
                    accuracy=float(res.accuracy),
                    truncated=c.finish_reason == "length"
                    and (not c.token_ids or c.token_ids[-1] != self.eos_id),
                    rollout_logprobs=list(c.logprobs),
                    token_versions=list(c.token_versions),
                    prompt_index=ref.index,
                )
            )
        return out

    def _drop_nonfinite(
        self, bad: list[int], completions: Sequence[Completion], results: Any, refs: Any, texts: Any
    ) -> tuple[list[Completion], list[Any], list[PromptRef], list[str]]:
        """``data.nonFiniteReward``: stop naming the reward function and the sample, or skip and count."""
        d = self.spec.data
        if d.non_finite_reward == "error":
            i = bad[0]
            c = completions[i]
            raise NonFiniteRewardError(
                f"reward function {d.reward!r} returned {float(results[i].score)} for sample "
                f"{c.request_id}#{c.sample_index} (prompt {refs[i].record.prompt[:60]!r}, response "
                f"{texts[i][:60]!r}; {len(bad)} of {len(results)} in this call): fix the reward function, "
                "or set data.nonFiniteReward: skip to leave such samples out and count them"
            )
        self.nonfinite_rewards += len(bad)
        drop = set(bad)
        keep = [i for i in range(len(results)) if i not in drop]
        return (
            [completions[i] for i in keep],
            [results[i] for i in keep],
            [refs[i] for i in keep],
            [texts[i] for i in keep],
        )

    def counters(self) -> dict[str, float]:
        """Run-long counts for metrics and status.progress (they survive a resume)."""
        return {
            "data/prompts_drawn": float(self.prompts_drawn),
            "data/prompts_too_long_total": float(self.prompts_too_long),
            "reward/nonfinite_total": float(self.nonfinite_rewards),
            **{k: float(v) for k, v in self.totals.items()},
        }

    # -- the update --------------------------------------------------------------------------
    def train(
        self, samples: Sequence[Sample], timing: dict[str, float], *, step_lr: bool = True
    ) -> dict[str, float]:
        """old log-prob -> (rollout correction) -> (ref) -> (values) -> advantages -> ppoEpochs x
        mini-batch updates.

        The old log-prob pass is skipped when the update is one epoch over one mini-batch (pi_old is
        the current weights: the update uses its own detached log-probs, ratio == 1) and the KL is
        not in the reward (that needs old log-probs before the advantages) and no rollout correction
        is asked for; ``actor/kl_ref`` then comes from the update's detached log-probs, which are the
        same pre-update log-probs.
        """
        spec = self.spec
        a = spec.algorithm
        batch = collate(samples, self.pad_id)
        n_groups = len(set(batch.group_index.tolist()))
        num_mini = max(1, round(n_groups / spec.training.mini_batch_size))
        kl_type = a.kl.kl_penalty if a.kl.in_reward else a.kl.kl_loss_type
        correction = a.effective_rollout_correction
        old_pass = (
            needs_old_logprob_pass(num_mini, a.ppo_epochs)
            or (a.kl.in_reward and self.ref is not None)
            or correction.mode != "off"  # the weights compare pi_old with the engine before the update
        )
        old_logp = None
        t0 = time.perf_counter()
        if old_pass:
            old_logp, _ = self.actor.compute_logprobs(batch)
            batch.extras["old_logp"] = old_logp
        metrics: dict[str, float] = {"actor/old_logprob_pass": float(old_pass)}
        if correction.mode != "off":
            assert old_logp is not None
            metrics.update(self._rollout_correction(batch, old_logp, samples))
        timing["old_log_prob"] = timing.get("old_log_prob", 0.0) + time.perf_counter() - t0
        mask = batch.response_mask
        token_rewards = None
        if self.ref is not None:
            t0 = time.perf_counter()
            ref_logp, _ = self.ref.compute_logprobs(batch)
            batch.extras["ref_logp"] = ref_logp
            timing["ref"] = timing.get("ref", 0.0) + time.perf_counter() - t0
            if old_logp is not None:
                kl = kl_penalty(old_logp, ref_logp, kl_type)
                metrics["actor/kl_ref"] = float(masked_mean(kl, mask))
        t0 = time.perf_counter()
        if a.kl.in_reward and self.ref is not None:
            base = scores_to_token_rewards(batch.scores, mask)
            assert old_logp is not None  # the KL in the reward always takes the old log-prob pass
            kl = kl_penalty(old_logp, batch.extras["ref_logp"], a.kl.kl_penalty)
            token_rewards = kl_in_reward(base, kl, a.kl.kl_coef, mask)
        if self.critic is not None:
            values = self.critic.compute_values(batch)
            batch.extras["values"] = values
            adv, returns = compute_advantages(
                a.effective_advantage_estimator,
                mask=mask,
                scores=batch.scores,
                token_rewards=token_rewards,
                values=values,
                gamma=a.gamma,
                lam=a.lam,
            )
            batch.extras["returns"] = returns
        else:
            adv, _ = compute_advantages(
                a.effective_advantage_estimator,
                mask=mask,
                scores=None if token_rewards is not None else batch.scores,
                token_rewards=token_rewards,
                group_index=batch.group_index,
                norm_by_std=a.norm_adv_by_std,
            )
        batch.extras["advantages"] = adv
        if "rollout_loss_mask" in batch.extras:  # mis: the tokens outside [1/C, C] leave the loss
            batch.response_mask = batch.extras.pop("rollout_loss_mask")
        timing["adv"] = timing.get("adv", 0.0) + time.perf_counter() - t0
        # Mini-batches of whole prompt groups, in a fresh random order of groups.
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(batch.group_index.tolist()):
            groups.setdefault(g, []).append(i)
        order = list(groups)
        self.rng.shuffle(order)
        rows = [i for g in order for i in groups[g]]
        batch = batch.select(rows)
        t0 = time.perf_counter()
        if self.critic is not None:
            metrics.update(self.critic.update(batch, num_mini, a.ppo_epochs))
            if step_lr:
                self.critic.lr_step()
        metrics.update(self.actor.update(batch, num_mini, a.ppo_epochs))
        if step_lr:
            self.actor.lr_step()
        timing["update_actor"] = timing.get("update_actor", 0.0) + time.perf_counter() - t0
        on_policy_logp = self.actor.last_update_logp
        if old_logp is None and self.ref is not None and on_policy_logp is not None:
            # the update's detached log-probs are the pre-update (old) ones, in this batch's row order
            kl = kl_penalty(on_policy_logp, batch.extras["ref_logp"], kl_type)
            metrics["actor/kl_ref"] = float(masked_mean(kl, batch.response_mask))
        metrics["actor/updates"] = float(num_mini * a.ppo_epochs)
        return metrics

    def _rollout_correction(
        self, batch: Batch, old_logp: torch.Tensor, samples: Sequence[Sample]
    ) -> dict[str, float]:
        """Put the rollout-correction weights and the loss mask (fewer tokens for mis) in
        ``batch.extras``; return the ``rollout_corr/*`` metrics. Advantages still see every token.

        The engines report raw (temperature-1) log-probs, so the trainer's side is taken at
        temperature 1 too: one more forward when the sampling temperature is not 1.
        """
        rc = self.spec.algorithm.effective_rollout_correction
        rollout_logp = batch.extras.get("rollout_logp")
        if rollout_logp is None:
            bad = next(s for s in samples if len(s.rollout_logprobs) != len(s.response_ids))
            raise ValueError(
                "algorithm.rolloutCorrection needs the engine's log-prob of every response token, but "
                f"sample {bad.group!r} has {len(bad.rollout_logprobs)} for {len(bad.response_ids)} tokens "
                f"(rollout.engine {self.spec.rollout.engine}): use an engine that returns them or remove "
                "rolloutCorrection"
            )
        trainer_logp = old_logp
        if self.loss_cfg.temperature != 1.0:
            trainer_logp, _ = self.actor.compute_logprobs(batch, temperature=1.0)
        corr = rollout_correction(trainer_logp, rollout_logp, batch.response_mask, rc.mode, rc.threshold)
        batch.extras["rollout_is_weights"] = corr.weights
        batch.extras["rollout_loss_mask"] = corr.mask
        return corr.as_dict()

    # -- weights -----------------------------------------------------------------------------
    def weight_buckets(self, version: int) -> list[Any]:
        """The next sync's buckets (full or delta per spec.weightSync.method)."""
        params = self.actor.full_named_parameters()
        if self.spec.weight_sync.method == "delta_sharded":
            return list(self.sender.delta(params, version))
        return list(self.sender.full(params, version))

    def sync_stats(self) -> dict[str, float]:
        st = self.sender.last_stats
        if st is None:
            return {}
        return {
            "weight_sync/payload_mb": st.payload_mb,
            "weight_sync/changed_ratio": st.changed_ratio,
            "weight_sync/buckets": float(st.buckets),
        }

    def direct_sync_stats(self, stats: list[Any]) -> dict[str, float]:
        """Metrics of a direct (bucket-free) full sync, shaped like ``sync_stats``."""
        done = [s for s in stats if s is not None]
        if not done:
            return {}
        return {
            "weight_sync/payload_mb": done[0].payload_mb,
            "weight_sync/changed_ratio": 1.0,
            "weight_sync/buckets": 0.0,
            "weight_sync/direct_copy_s": sum(s.seconds for s in done),
        }

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs except the replay buffer (the driver adds it)."""
        return {
            "step": self.step,
            "version": self.version,
            "prompts_drawn": self.prompts_drawn,
            "prompts_too_long": self.prompts_too_long,
            "nonfinite_rewards": self.nonfinite_rewards,
            "totals": dict(self.totals),
            "sampler": self.sampler.state_dict(),
            "actor": self.actor.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "rng": {
                "python": self.rng.getstate(),
                "torch": torch.get_rng_state(),
                "global_python": random.getstate(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.version = int(state["version"])
        self.prompts_drawn = int(state["prompts_drawn"])
        self.prompts_too_long = int(state.get("prompts_too_long", 0))
        self.nonfinite_rewards = int(state.get("nonfinite_rewards", 0))
        for k, v in state.get("totals", {}).items():  # in place: the mode driver holds this Counter
            self.totals[k] = int(v)
        self.sampler.load_state_dict(state["sampler"])
        self.actor.load_state_dict(state["actor"])
        if self.critic is not None and state.get("critic") is not None:
            self.critic.load_state_dict(state["critic"])
        rng = state["rng"]
        self.rng.setstate(_as_state(rng["python"]))
        random.setstate(_as_state(rng["global_python"]))
        torch.set_rng_state(rng["torch"])
        self.sender.reset()  # the engine starts from the checkpoint's weights: first sync is dense


def check_model_dir(field: str, path: str, need: str = "config.json") -> None:
    """A local Hugging Face directory, or a UserError naming the field (never a hub lookup)."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(
            f"{field}: {path} is not a directory on this machine/pod; point it at a Hugging Face model "
            "directory (config.json, weights, tokenizer) or mount one there"
        )
    if need == "config.json" and not (p / "config.json").is_file():
        raise UserError(f"{field}: {path} has no config.json; point it at a Hugging Face model directory")


def load_data(field: str, path: str, prompt_key: str, answer_key: str) -> list[Record]:
    """Records of a data file, or a UserError naming the field, the file and what is wrong."""
    try:
        records = load_records(path, prompt_key=prompt_key, answer_key=answer_key)
    except (OSError, ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise UserError(f"{field}: {msg}") from e
    if not records:
        raise UserError(f"{field}: {path} holds no records; point it at a non-empty .jsonl or .parquet file")
    return records


def _as_state(s: Any) -> Any:
    """random.getstate() round-trips through torch.save as nested tuples/lists: make it tuples."""
    if isinstance(s, list):
        return tuple(_as_state(x) for x in s)
    return s


def sample_metrics(samples: Iterable[Sample], version: int) -> dict[str, float]:
    """Reward, accuracy, length and staleness of the samples a step trained on."""
    ss = list(samples)
    if not ss:
        return {}
    n = len(ss)
    rewards = [s.reward for s in ss]
    lengths = [len(s.response_ids) for s in ss]
    stale = [version - s.policy_version for s in ss]
    mean_r = sum(rewards) / n
    return {
        "reward/mean": mean_r,
        "reward/std": (sum((r - mean_r) ** 2 for r in rewards) / n) ** 0.5,
        "reward/accuracy": sum(s.accuracy for s in ss) / n,
        "reward/score_mean": sum(s.score for s in ss) / n,
        "response_length/mean": sum(lengths) / n,
        "response_length/max": float(max(lengths)),
        "response_length/clip_ratio": sum(s.truncated for s in ss) / n,
        "staleness/mean": sum(stale) / n,
        "staleness/max": float(max(stale)),
        "rollout/partial_ratio": sum(s.resumed for s in ss) / n,
        "batch/samples": float(n),
        "batch/response_tokens": float(sum(lengths)),
        "batch/prompt_tokens": float(sum(len(s.prompt_ids) for s in ss)),
    }
