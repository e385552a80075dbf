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
from rlkube.runtime.distributed.ranks import PAD, LearnerGroup, split_rows
from rlkube.runtime.errors import NonFiniteRewardError, UserError
from rlkube.runtime.rewards import get_reward_fn
from rlkube.runtime.rollout.base import Completion, RolloutRequest, SamplingParams
from rlkube.runtime.trainer.batch import Batch, Sample, collate
from rlkube.runtime.trainer.learner import Learner, loss_config
from rlkube.runtime.trainer.policy import needs_old_logprob_pass

log = logging.getLogger(__name__)


@dataclass
class PromptRef:
    """A prompt in flight: its record and its index in the training stream."""

    record: Record
    index: int
    prompt_ids: list[int]


class Trainer:
    """Algorithm state of one RLJob: actor (+ ref, critic), sampler, reward, weight version."""

    def __init__(
        self,
        job: RLJob,
        *,
        device: str | None = None,
        learner: Learner | None = None,
        peers: Sequence[Any] = (),
    ) -> None:
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
        self.loss_cfg = loss_config(spec)
        if learner is None:
            learner = Learner(spec, device=device)
        # Every rank's models; rank 0 (this process) is ``learner``, the others are Ray actors.
        self.learners = LearnerGroup(learner, peers)
        self.world_size = self.learners.world_size
        self.actor = learner.actor
        self.ref = learner.ref
        self.critic = learner.critic
        self.use_ref = self.ref is not None
        self.sender = learner.sender
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

        The batch's prompt groups are put in a fresh random order and split over the trainer ranks
        (:func:`~rlkube.runtime.distributed.ranks.split_rows`: each mini-batch's groups shared
        equally; a batch that does not divide is padded with rows that carry no tokens); every rank
        computes its rows' log-probs and values, advantages are computed here over the whole batch
        (group baselines and batch whitening see every sample), and each rank updates on its rows
        with loss denominators of the global mini-batch, so N ranks make the same update as one.

        The old log-prob pass is skipped when the update is one epoch over one mini-batch (pi_old is
        the current weights: the update uses its own detached log-probs, ratio == 1) and the KL is
        not in the reward (that needs old log-probs before the advantages) and no rollout correction
        is asked for; ``actor/kl_ref`` then comes from the update's detached log-probs, which are the
        same pre-update log-probs.
        """
        spec = self.spec
        a = spec.algorithm
        batch = collate(samples, self.pad_id)
        mask = batch.response_mask
        n_groups = len(set(batch.group_index.tolist()))
        num_mini = max(1, round(n_groups / spec.training.mini_batch_size))
        kl_type = a.kl.kl_penalty if a.kl.in_reward else a.kl.kl_loss_type
        correction = a.effective_rollout_correction
        old_pass = (
            needs_old_logprob_pass(num_mini, a.ppo_epochs)
            or (a.kl.in_reward and self.ref is not None)
            or correction.mode != "off"  # the weights compare pi_old with the engine before the update
        )
        # Mini-batches of whole prompt groups, in a fresh random order of groups, split over ranks.
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(batch.group_index.tolist()):
            groups.setdefault(g, []).append(i)
        order = list(groups)
        self.rng.shuffle(order)
        plan = split_rows([groups[g] for g in order], num_mini, self.world_size)
        flat = [i for r in plan for i in r]
        rows = torch.tensor([i for i in flat if i != PAD], dtype=torch.long)
        real = torch.tensor([i != PAD for i in flat])  # the ranks' outputs without padding rows
        wants = {
            "old": old_pass,
            # rollout correction compares with the engines' raw (temperature-1) log-probs
            "raw": correction.mode != "off" and self.loss_cfg.temperature != 1.0,
            "ref": self.ref is not None,
            "values": self.critic is not None,
        }
        prepared = self.learners.call("prepare", [((_shard(batch, r),), wants) for r in plan])
        for key in ("old_logp", "raw_logp", "ref_logp", "values"):
            if key in prepared[0]:
                batch.extras[key] = _unsplit(torch.cat([p[key] for p in prepared])[real], rows)
        rank0 = prepared[0]["timing"]
        timing["old_log_prob"] = timing.get("old_log_prob", 0.0) + rank0.get("old_log_prob", 0.0)
        if "ref" in rank0:
            timing["ref"] = timing.get("ref", 0.0) + rank0["ref"]
        old_logp = batch.extras.get("old_logp")
        metrics: dict[str, float] = {"actor/old_logprob_pass": float(old_pass)}
        if correction.mode != "off":
            assert old_logp is not None
            metrics.update(self._rollout_correction(batch, batch.extras.pop("raw_logp", old_logp), samples))
        token_rewards = None
        if old_logp is not None and "ref_logp" in batch.extras:
            kl = kl_penalty(old_logp, batch.extras["ref_logp"], kl_type)
            metrics["actor/kl_ref"] = float(masked_mean(kl, mask))
        t0 = time.perf_counter()
        if a.kl.in_reward and self.ref is not None:
            base = scores_to_token_rewards(batch.scores, mask)
            assert old_logp is not None  # the KL in the reward always takes the old log-prob pass
            kl = kl_penalty(old_logp, batch.extras["ref_logp"], a.kl.kl_penalty)
            token_rewards = kl_in_reward(base, kl, a.kl.kl_coef, mask)
        if self.critic is not None:
            adv, returns = compute_advantages(
                a.effective_advantage_estimator,
                mask=mask,
                scores=batch.scores,
                token_rewards=token_rewards,
                values=batch.extras["values"],
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
        t0 = time.perf_counter()
        updated = self.learners.call(
            "update", [((_shard(batch, r), num_mini, a.ppo_epochs, step_lr), {}) for r in plan]
        )
        metrics.update(updated[0][0])  # already reduced over ranks
        timing["update_actor"] = timing.get("update_actor", 0.0) + time.perf_counter() - t0
        if old_logp is None and "ref_logp" in batch.extras and updated[0][1] is not None:
            # the update's detached log-probs are the pre-update (old) ones
            on_policy_logp = _unsplit(torch.cat([u[1] for u in updated])[real], rows)
            kl = kl_penalty(on_policy_logp, batch.extras["ref_logp"], kl_type)
            metrics["actor/kl_ref"] = float(masked_mean(kl, batch.response_mask))
        metrics["actor/updates"] = float(num_mini * a.ppo_epochs)
        metrics["trainer/world_size"] = float(self.world_size)
        return metrics

    def _rollout_correction(
        self, batch: Batch, trainer_logp: torch.Tensor, samples: Sequence[Sample]
    ) -> dict[str, float]:
        """Put the rollout-correction weights and the loss mask (fewer tokens for mis) in
        ``batch.extras``; return the ``rollout_corr/*`` metrics. Advantages still see every token.

        The engines report raw (temperature-1) log-probs, so ``trainer_logp`` is taken at
        temperature 1 too (the ranks ran one more forward when the sampling temperature is not 1).
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
        corr = rollout_correction(trainer_logp, rollout_logp, batch.response_mask, rc.mode, rc.threshold)
        batch.extras["rollout_is_weights"] = corr.weights
        batch.extras["rollout_loss_mask"] = corr.mask
        return corr.as_dict()

    # -- weights -----------------------------------------------------------------------------
    def weight_buckets(self, version: int) -> list[Any]:
        """The next sync's buckets (full or delta per spec.weightSync.method), as one list on rank 0.

        ``full``: rank 0 gathers the full tensors (the other ranks take part in each gather);
        ``delta_sharded``: every rank diffs its own shard and rank 0 joins their buckets.
        """
        from rlkube.runtime.weights.collective import as_one_sync

        if self.spec.weight_sync.method == "delta_sharded":
            peers = self.learners.start_peers("delta_buckets", version)
            mine = self.learners.local.delta_buckets(version)
            theirs = self.learners.wait(peers)
            return mine if not theirs else as_one_sync([b for bs in [mine, *theirs] for b in bs])
        peers = self.learners.start_peers("iterate_full_parameters")
        buckets = list(self.sender.full(self.actor.full_named_parameters(), version))
        self.learners.wait(peers)
        return buckets

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
        """Rank 0's part of a resume: counters, prompt stream, RNG (the replay buffer is the
        driver's; models, optimisers and schedulers are every rank's shards: :meth:`save_models`)."""
        return {
            "step": self.step,
            "version": self.version,
            "prompts_drawn": self.prompts_drawn,
            "prompts_too_long": self.prompts_too_long,
            "nonfinite_rewards": self.nonfinite_rewards,
            "totals": dict(self.totals),
            "sampler": self.sampler.state_dict(),
            "world_size": self.world_size,
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
        rng = state["rng"]
        self.rng.setstate(_as_state(rng["python"]))
        random.setstate(_as_state(rng["global_python"]))
        torch.set_rng_state(rng["torch"])

    def save_models(self, path: str | Path) -> None:
        """Every rank writes its shards of the models, optimisers and schedulers into ``path``
        (a directory all ranks reach: a shared volume when the ranks span pods)."""
        self.learners.call_all("save_shards", str(path))

    def load_models(self, path: str | Path) -> None:
        """Every rank reads its shards back, resharded to this world size (a checkpoint written by
        N ranks resumes on M); senders restart dense, as the engines load the checkpoint's weights."""
        self.learners.call_all("load_shards", str(path))


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


def _shard(batch: Batch, rows: Sequence[int]) -> Batch:
    """A rank's rows of ``batch``; :data:`PAD` rows are copies of row 0 with no response tokens,
    marked in ``extras["real_rows"]`` so they count as no sequence (see ``global_counts``)."""
    if PAD not in rows:
        return batch.select(rows)
    real = torch.tensor([r != PAD for r in rows])
    shard = batch.select([r if r != PAD else 0 for r in rows])
    shard.response_mask[~real] = 0.0
    shard.extras["real_rows"] = real.float()
    return shard


def _unsplit(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per-row tensors computed in ``rows`` order (the ranks' rows, concatenated) back in batch order."""
    out = torch.empty_like(values)
    out[rows] = values
    return out
