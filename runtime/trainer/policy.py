"""The actor (trainable) and the reference policy (frozen) over a Hugging Face causal LM.

fp32 master weights, bf16 autocast on GPUs (FSDP2 mixed precision with more than one rank).
Gradient accumulation over micro-batches is exact: every micro-batch's loss is divided by the token
(or sequence) count of its whole mini-batch, so the summed gradients equal those of one big batch
whatever the micro-batch size (tests check this).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from rlkube.runtime.algos import (
    POLICY_LOSSES,
    PolicyLossMetrics,
    aggregate_loss,
    kl_penalty,
    masked_mean,
)
from rlkube.runtime.trainer.batch import Batch
from rlkube.runtime.trainer.modeling import accepts_logits_to_keep, compile_decoder_layers, load_causal_lm
from rlkube.runtime.trainer.token_logprob import token_logprobs
from rlkube.runtime.trainer.worker import (
    LossConfig,
    OptimConfig,
    TrainWorker,
    accumulate,
    lr_lambda,
    scatter_pass,
)


def needs_old_logprob_pass(num_mini_batches: int, epochs: int) -> bool:
    """Does an update of ``epochs`` x ``num_mini_batches`` need pi_old log-probs from their own pass?

    One epoch over one mini-batch (the whole batch) is exactly on-policy: pi_old is the current
    weights, so the old log-probs equal the detached log-probs of the update's own forward pass
    (ratio == 1) and the extra no-grad forward over the batch can be skipped. Any later mini-batch or
    epoch runs after an optimiser step, so it needs the log-probs computed before the first one.
    """
    return not (num_mini_batches == 1 and epochs == 1)


def response_logits_window(model: nn.Module, mb: Batch) -> tuple[Tensor, int]:
    """The model's logits and the first of the ``T`` positions that predict the response tokens.

    Rows are ``[prompt (width p) | response (width T)]``, so with ``L = p + T`` the logits predicting
    response tokens sit at ``[p - 1, p - 1 + T) = [L - T - 1, L - 1)``: when the model takes
    ``logits_to_keep`` only the last ``T + 1`` positions go through the LM head (not all ``L``) and
    the window starts at 0. The whole output is returned (not a slice): :func:`token_logprobs`
    reads the window and writes the gradient of every position in one pass.
    """
    p, t = mb.prompt_width, mb.responses.shape[1]
    kwargs: dict[str, Any] = {}
    keep = mb.input_ids.shape[1] == p + t and p >= 1 and accepts_logits_to_keep(model)
    if keep:
        kwargs["logits_to_keep"] = t + 1
    out = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, **kwargs
    )
    return out.logits, (0 if keep else p - 1)


def response_logits(model: nn.Module, mb: Batch) -> Tensor:
    """Logits predicting each response token, ``[b, T, V]`` (a view of the model's output; the
    sampling temperature is applied by :func:`token_logprobs`)."""
    logits, first = response_logits_window(model, mb)
    return logits[:, first : first + mb.responses.shape[1]]


class PolicyWorker(TrainWorker):
    """The actor (trainable) or the reference policy (frozen): log-probs, entropy, PPO updates."""

    def __init__(
        self,
        model_path: str,
        *,
        trainable: bool = True,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        device: str | torch.device | None = None,
        bf16: bool | None = None,
        micro_batch_size: int = 8,
        micro_batch_tokens: int = 0,
        gradient_checkpointing: bool = False,
        model: nn.Module | None = None,
        replicate: int = 1,
        config_overrides: dict[str, Any] | None = None,
        compile_layers: bool = False,
    ) -> None:
        super().__init__(
            device=device,
            bf16=bf16,
            micro_batch_size=micro_batch_size,
            replicate=replicate,
            micro_batch_tokens=micro_batch_tokens,
        )
        self.loss_cfg = loss or LossConfig()
        self.optim_cfg = optim or OptimConfig()
        self.trainable = trainable
        if model is None:
            model = load_causal_lm(
                model_path,
                device=self.device,
                gradient_checkpointing=gradient_checkpointing,
                config_overrides=config_overrides,
            )
        else:  # an in-memory model (benchmarks): fp32 master weights on this worker's device
            model = model.to(device=self.device, dtype=torch.float32)
        self.model = self._wrap(model)
        self.compiled_layers = compile_decoder_layers(self.model) if compile_layers else 0
        self.num_params = sum(p.numel() for p in model.parameters())
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.last_update_logp: Tensor | None = None  # on-policy updates: the detached old log-probs
        if trainable:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(),
                lr=self.optim_cfg.lr,
                betas=self.optim_cfg.betas,
                weight_decay=self.optim_cfg.weight_decay,
                fused=self.device.type == "cuda",  # one kernel per step instead of a foreach chain
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.optim_cfg))
        else:
            self.model.requires_grad_(False)
        self.model.eval()

    # -- inference ---------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(
        self, batch: Batch, with_entropy: bool = False, *, temperature: float | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Per-token log-probs ``[B, T]`` (and entropy) under the current weights, float32 on CPU, at
        the loss's sampling temperature unless ``temperature`` is given (1.0: the engines' raw view)."""
        temp = self.loss_cfg.temperature if temperature is None else temperature
        lp_out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=self.device)
        ent_out = torch.zeros_like(lp_out) if with_entropy else None
        self.model.eval()
        with self.autocast():  # one context: each weight cast once (see TrainWorker.autocast)
            for plan in self.plan_micro_batches(batch):
                logits, first = response_logits_window(self.model, plan.batch)
                if plan.stand_in:
                    continue
                with self.autocast_off():
                    logp, ent = token_logprobs(logits, plan.batch.responses, temp or 1.0, first=first)
                    scatter_pass(lp_out, plan, logp)
                    if ent_out is not None:
                        scatter_pass(ent_out, plan, ent)
        return lp_out.cpu(), (ent_out.cpu() if ent_out is not None else None)

    # -- training ----------------------------------------------------------------------------
    def update(self, batch: Batch, num_mini_batches: int, epochs: int = 1) -> dict[str, float]:
        """``epochs`` passes of ``num_mini_batches`` optimiser updates over ``batch``.

        ``batch.extras`` must hold ``advantages`` (and ``ref_logp`` with a KL loss; ``rollout_is_weights``
        ``[B, T]``, when present, multiply the per-token policy loss), and ``old_logp``
        unless the update is one epoch over one mini-batch: then pi_old is the current weights and the
        detached log-probs of the update's own forward pass are used (see
        :func:`needs_old_logprob_pass`); they are kept, in ``batch`` row order on the CPU, in
        :attr:`last_update_logp` for metrics that compare against old log-probs.
        Rows are taken in order (the caller shuffles); the LR scheduler is stepped by the caller.
        """
        if self.optimizer is None:
            raise RuntimeError("the reference policy is not trainable")
        on_policy = "old_logp" not in batch.extras
        if on_policy and needs_old_logprob_pass(num_mini_batches, epochs):
            raise ValueError(
                "batch.extras['old_logp'] is required for multi-mini-batch/multi-epoch updates "
                f"(num_mini_batches={num_mini_batches}, epochs={epochs}): compute it with "
                "compute_logprobs() before the update"
            )
        self.last_update_logp = None
        kept: list[Tensor] | None = [] if on_policy else None
        cfg = self.loss_cfg
        sums: dict[str, float] = {}
        count = 0
        self.model.train()
        rows = batch.size
        per_mini = max(rows // num_mini_batches, 1)
        for _ in range(epochs):
            for start in range(0, rows, per_mini):
                mini = batch.rows(start, min(start + per_mini, rows))  # views: read only
                stats = self._mini_step(mini, cfg, kept)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        self.model.eval()
        if kept is not None:
            self.last_update_logp = torch.cat(kept).cpu()
        return {k: v / max(count, 1) for k, v in sums.items()}

    def _mini_step(self, mini: Batch, cfg: LossConfig, kept: list[Tensor] | None = None) -> dict[str, float]:
        """One optimiser step over ``mini``; without ``old_logp`` in its extras the update is
        on-policy (the caller checked) and the detached log-probs (kept in ``kept``) stand in."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        g_tokens, g_seqs = self.global_counts(mini)
        # Token share of each micro-batch (for metrics), from the host copy of the mask; the
        # mini-batch then moves to the device once and metrics stay on it until the end: no host
        # sync per micro-batch, so kernel launches keep running ahead of the GPU.
        mini_tokens = float(mini.response_mask.sum())
        n_tok = max(mini_tokens, 1.0)
        row_tokens = mini.response_mask.sum(1).tolist()
        plans = self.plan_micro_batches(mini)
        weights = [sum(row_tokens[r] for r in p.rows) / n_tok for p in plans]
        acc: dict[str, Tensor] = {}
        ratio_max: Tensor | None = None
        # The counts above are divided by the world size to undo the ranks' gradient averaging; a
        # token-sum has no count, so its gradient is scaled back up instead.
        sum_scale = float(self.world_size) if cfg.agg_mode == "token-sum" else 1.0
        agg = {"global_tokens": g_tokens, "global_seqs": g_seqs, "norm_constant": cfg.norm_constant}
        # On-policy: the detached log-probs, back in the mini-batch's row order.
        mini_logp = (
            torch.zeros(mini.responses.shape, dtype=torch.float32, device=self.device)
            if kept is not None and "old_logp" not in mini.extras
            else None
        )
        # One autocast context over every micro-batch: each fp32 master weight is cast to bf16 once
        # per optimiser step, not once per micro-batch (autocast's cast cache lives as long as the
        # outermost context). The loss and the backward pass run with autocast paused, as before.
        with self.autocast():
            for weight, plan in zip(weights, plans, strict=True):
                logits, first = response_logits_window(self.model, plan.batch)
                with self.autocast_off():
                    loss, pg, weighted, m, logp = self._micro_loss(plan.batch, logits, first, cfg, agg)
                    if plan.stand_in:  # keeps this rank's collectives in step; adds nothing
                        (loss * 0.0).backward()
                        continue
                    (loss * sum_scale).backward()
                    if mini_logp is not None:
                        scatter_pass(mini_logp, plan, logp)
                    # micro losses already sum to the mini-batch loss; the rest are token-weighted means
                    accumulate(acc, "actor/pg_loss", pg.detach().float())
                    for k, v in weighted.items():
                        accumulate(acc, k, v.detach().float() * weight)
                    r = m.ratio_max.detach().float()
                    ratio_max = r if ratio_max is None else torch.maximum(ratio_max, r)
        if kept is not None and mini_logp is not None:
            kept.append(mini_logp)
        # Over ranks: the loss is averaged (each rank's is scaled for the global batch), the rest
        # weighted by each rank's tokens, the ratio maxed.
        pg_loss = acc.pop("actor/pg_loss") * sum_scale  # token-sum: the ranks' losses add up
        out = self.reduce_metrics(
            {"actor/pg_loss": pg_loss},
            acc,
            float(mini_tokens),
            {"actor/ratio_max": ratio_max} if ratio_max is not None else {},
        )
        out["actor/grad_norm"] = self._clip_and_step()
        out["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return out

    def _micro_loss(
        self,
        mb: Batch,
        logits: Tensor,
        first: int,
        cfg: LossConfig,
        agg: dict[str, float],
    ) -> tuple[Tensor, Tensor, dict[str, Tensor], PolicyLossMetrics, Tensor]:
        """One micro-batch's loss (policy loss, entropy bonus, KL loss), its policy-loss part, the
        token-weighted metrics, the policy loss's own metrics and the detached log-probs; positions
        ``[first, first + T)`` of ``logits`` predict the response tokens."""
        logp, ent = token_logprobs(
            logits, mb.responses, cfg.temperature or 1.0, entropy_grad=cfg.entropy_coeff > 0, first=first
        )
        mask = mb.response_mask
        old_logp = mb.extras.get("old_logp")
        if old_logp is None:  # one epoch x one mini-batch: pi_old is these weights (ratio == 1)
            old_logp = logp.detach()
        pg, m = POLICY_LOSSES[cfg.policy_loss](
            logp,
            old_logp,
            mb.extras["advantages"],
            mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            clip_c=cfg.clip_c,
            agg_mode=cfg.agg_mode,
            is_weights=mb.extras.get("rollout_is_weights"),
            **agg,
        )
        loss = pg
        ent_val = masked_mean(ent.detach(), mask)
        if cfg.entropy_coeff > 0:
            loss = loss - cfg.entropy_coeff * aggregate_loss(ent, mask, cfg.agg_mode, **agg)
        weighted: dict[str, Tensor] = {
            "actor/entropy": ent_val,
            "actor/clip_frac": m.clip_frac,
            "actor/clip_frac_upper": m.clip_frac_upper,
            "actor/clip_frac_lower": m.clip_frac_lower,
            "actor/dual_clip_frac": m.dual_clip_frac,
            "actor/approx_kl": m.approx_kl,
        }
        if cfg.use_kl_loss and "ref_logp" in mb.extras:
            kl = kl_penalty(logp, mb.extras["ref_logp"], cfg.kl_loss_type)
            kl_loss = aggregate_loss(kl, mask, cfg.agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            weighted["actor/kl_loss"] = masked_mean(kl.detach(), mask)
        return loss, pg, weighted, m, logp.detach().float()

    def _clip_and_step(self) -> float:
        assert self.optimizer is not None
        clip = self.optim_cfg.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm_f = float(norm)
        if math.isfinite(norm_f):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm_f

    def lr_step(self) -> None:
        """Advance the LR schedule by one training step."""
        if self.scheduler is not None:
            self.scheduler.step()

    # -- weights and state -------------------------------------------------------------------
    def full_named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named full tensors (FSDP2 shards gathered), detached, what the rollout engine loads."""
        for name, p in self.model.state_dict().items():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, t.detach()
