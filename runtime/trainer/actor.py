"""Actor, reference and critic workers over Hugging Face causal LMs.

One process on the CPU; on GPUs the model is wrapped with FSDP2 (``fully_shard`` per decoder layer,
then the root) when a process group of more than one rank is up, with bf16 compute and fp32 master
weights. Gradient accumulation over micro-batches is exact: every micro-batch's loss is divided by
the token (or sequence) count of its whole mini-batch, so the summed gradients equal those of one
big batch whatever the micro-batch size (tests check this).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlkube.runtime.algos import (
    POLICY_LOSSES,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    value_loss,
)
from rlkube.runtime.trainer.batch import Batch


@dataclass(frozen=True)
class OptimConfig:
    """Optimiser and schedule of one trainable worker."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    warmup_steps: int = 0
    total_steps: int = 100
    schedule: str = "constant"  # constant | cosine | linear (after warmup)
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class LossConfig:
    """The policy loss knobs, straight from ``spec.algorithm``."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = 3.0
    policy_loss: str = "vanilla"  # a name in rlkube.runtime.algos.POLICY_LOSSES
    agg_mode: str = "token-mean"
    norm_constant: float | None = None  # seq-mean-token-sum-norm's H (the max response length)
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    value_clip: float = 0.2

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"unknown policy loss {self.policy_loss!r}; expected one of {', '.join(POLICY_LOSSES)}"
            )


def lr_lambda(cfg: OptimConfig) -> Any:
    """Multiplier of the base LR at a step: linear warmup, then constant / cosine / linear decay to 0."""

    def f(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(cfg.total_steps - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        if cfg.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if cfg.schedule == "linear":
            return 1.0 - progress
        raise ValueError(f"unknown lr schedule {cfg.schedule!r}")

    return f


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_causal_lm(
    path: str,
    *,
    device: torch.device,
    gradient_checkpointing: bool = False,
    config_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """fp32 master weights (bf16 compute comes from autocast / FSDP2 mixed precision).

    ``config_overrides`` replace config.json fields (``model.maxPositionEmbeddings``).
    """
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **(config_overrides or {}))
    model = model.to(device)
    if gradient_checkpointing and device.type != "cpu":
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def shard_fsdp2(model: nn.Module, device: torch.device, bf16: bool) -> nn.Module:
    """FSDP2: shard every decoder layer, then the root, over the default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is not None:
        for layer in layers:
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def micro_batches(batch: Batch, size: int) -> Iterator[Batch]:
    for start in range(0, batch.size, size):
        yield batch.rows(start, min(start + size, batch.size))


def _accumulate(acc: dict[str, Tensor], key: str, value: Tensor) -> None:
    acc[key] = acc[key] + value if key in acc else value


class _Worker:
    """What actor, reference and critic share: device, autocast, FSDP2 wrapping."""

    def __init__(
        self, *, device: str | torch.device | None, bf16: bool | None, micro_batch_size: int
    ) -> None:
        self.device = resolve_device(device)
        self.bf16 = self.device.type != "cpu" if bf16 is None else bf16
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = world()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.bf16 and self.world_size == 1:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.world_size > 1:
            return shard_fsdp2(model, self.device, self.bf16)
        return model


def needs_old_logprob_pass(num_mini_batches: int, epochs: int) -> bool:
    """Does an update of ``epochs`` x ``num_mini_batches`` need pi_old log-probs from their own pass?

    One epoch over one mini-batch (the whole batch) is exactly on-policy: pi_old is the current
    weights, so the old log-probs equal the detached log-probs of the update's own forward pass
    (ratio == 1) and the extra no-grad forward over the batch can be skipped. Any later mini-batch or
    epoch runs after an optimiser step, so it needs the log-probs computed before the first one.
    """
    return not (num_mini_batches == 1 and epochs == 1)


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose ``forward`` signature matters: through torch.compile / DDP wrappers."""
    for attr in ("_orig_mod", "module"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            return _unwrap(inner)
    return model


_KEEPS_LOGITS: dict[type, bool] = {}


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the (unwrapped) model's forward takes HF's ``logits_to_keep`` (cached per class)."""
    inner = _unwrap(model)
    cls = type(inner)
    if cls not in _KEEPS_LOGITS:
        import inspect

        try:
            params = inspect.signature(inner.forward).parameters
            _KEEPS_LOGITS[cls] = "logits_to_keep" in params
        except (TypeError, ValueError):
            _KEEPS_LOGITS[cls] = False
    return _KEEPS_LOGITS[cls]


def response_logits(model: nn.Module, mb: Batch, temperature: float) -> Tensor:
    """Logits predicting each response token, ``[b, T, V]``, divided by the sampling temperature.

    Rows are ``[prompt (width p) | response (width T)]``, so with ``L = p + T`` the logits predicting
    response tokens sit at ``[p - 1, p - 1 + T) = [L - T - 1, L - 1)``: when the model takes
    ``logits_to_keep`` only the last ``T + 1`` positions go through the LM head (not all ``L``).
    """
    p, t = mb.prompt_width, mb.responses.shape[1]
    kwargs: dict[str, Any] = {}
    keep = mb.input_ids.shape[1] == p + t and p >= 1 and accepts_logits_to_keep(model)
    if keep:
        kwargs["logits_to_keep"] = t + 1
    out = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, **kwargs
    )
    logits = out.logits[:, :t] if keep else out.logits[:, p - 1 : p - 1 + t]
    return logits / temperature if temperature not in (0.0, 1.0) else logits


class PolicyWorker(_Worker):
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
        gradient_checkpointing: bool = False,
        model: nn.Module | None = None,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(device=device, bf16=bf16, micro_batch_size=micro_batch_size)
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
        lps, ents = [], []
        temp = self.loss_cfg.temperature if temperature is None else temperature
        self.model.eval()
        for mb in micro_batches(batch, self.micro_batch_size):
            mb = mb.to(self.device)
            with self.autocast():
                logits = response_logits(self.model, mb, temp)
            lps.append(logprobs_from_logits(logits, mb.responses).cpu())
            if with_entropy:
                ents.append(entropy_from_logits(logits).cpu())
        return torch.cat(lps), (torch.cat(ents) if with_entropy else None)

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
                mini = batch.select(list(range(start, min(start + per_mini, rows))))
                stats = self._mini_step(mini, cfg, kept)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        self.model.eval()
        if kept is not None:
            self.last_update_logp = torch.cat(kept).cpu()
        return {k: v / max(count, 1) for k, v in sums.items()}

    def _global_counts(self, mini: Batch) -> tuple[float, int]:
        tokens = float(mini.response_mask.sum().item())
        seqs = mini.size
        if self.world_size > 1:
            import torch.distributed as dist

            t = torch.tensor([tokens, float(seqs)], device=self.device)
            dist.all_reduce(t)
            # DDP/FSDP average gradients over ranks: scale the denominators back to a global sum.
            tokens, seqs = float(t[0]) / self.world_size, int(t[1].item()) // self.world_size
        return tokens, seqs

    def _mini_step(self, mini: Batch, cfg: LossConfig, kept: list[Tensor] | None = None) -> dict[str, float]:
        """One optimiser step over ``mini``; without ``old_logp`` in its extras the update is
        on-policy (the caller checked) and the detached log-probs (kept in ``kept``) stand in."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        g_tokens, g_seqs = self._global_counts(mini)
        # Token share of each micro-batch (for metrics), from the host copy of the mask; the
        # mini-batch then moves to the device once and metrics stay on it until the end: no host
        # sync per micro-batch, so kernel launches keep running ahead of the GPU.
        n_tok = max(float(mini.response_mask.sum()), 1.0)
        weights = [float(mb.response_mask.sum()) / n_tok for mb in micro_batches(mini, self.micro_batch_size)]
        mini = mini.to(self.device)
        acc: dict[str, Tensor] = {}
        ratio_max: Tensor | None = None
        policy_loss = POLICY_LOSSES[cfg.policy_loss]
        # The counts above are divided by the world size to undo the ranks' gradient averaging; a
        # token-sum has no count, so its gradient is scaled back up instead.
        sum_scale = float(self.world_size) if cfg.agg_mode == "token-sum" else 1.0
        for weight, mb in zip(weights, micro_batches(mini, self.micro_batch_size), strict=True):
            with self.autocast():
                logits = response_logits(self.model, mb, cfg.temperature)
            logp = logprobs_from_logits(logits, mb.responses)
            mask = mb.response_mask
            old_logp = mb.extras.get("old_logp")
            if old_logp is None:  # one epoch x one mini-batch: pi_old is these weights (ratio == 1)
                old_logp = logp.detach()
                if kept is not None:
                    kept.append(old_logp.float())
            agg = {"global_tokens": g_tokens, "global_seqs": g_seqs, "norm_constant": cfg.norm_constant}
            pg, m = policy_loss(
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
            if cfg.entropy_coeff > 0:
                ent = entropy_from_logits(logits)
                ent_val = masked_mean(ent.detach(), mask)
                ent_loss = aggregate_loss(ent, mask, cfg.agg_mode, **agg)
                loss = loss - cfg.entropy_coeff * ent_loss
            else:  # metric only: no autograd graph over the [b, T, V] float32 temporaries
                with torch.no_grad():
                    ent_val = masked_mean(entropy_from_logits(logits.detach()), mask)
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
            (loss * sum_scale).backward()
            # micro losses already sum to the mini-batch loss; the rest are token-weighted means
            _accumulate(acc, "actor/pg_loss", pg.detach().float())
            for k, v in weighted.items():
                _accumulate(acc, k, v.detach().float() * weight)
            r = m.ratio_max.detach().float()
            ratio_max = r if ratio_max is None else torch.maximum(ratio_max, r)
        if ratio_max is not None:
            acc["actor/ratio_max"] = ratio_max
        out = dict(zip(acc, torch.stack([v.reshape(()) for v in acc.values()]).tolist(), strict=True))
        out["actor/grad_norm"] = self._clip_and_step()
        out["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        return out

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

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": {k: v.detach().cpu() for k, v in self.full_named_parameters()}}
        if self.optimizer is not None and self.scheduler is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            for k, v in state["model"].items():
                dst = own[k]
                if hasattr(dst, "full_tensor"):
                    from torch.distributed.tensor import distribute_tensor

                    dst.copy_(distribute_tensor(v.to(self.device), dst.device_mesh, dst.placements))
                else:
                    dst.copy_(v.to(dst.device))
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])


class ValueModel(nn.Module):
    """A critic: the policy's transformer body with a scalar head instead of the LM head."""

    def __init__(self, lm: Any) -> None:
        super().__init__()
        self.body = getattr(lm, "model", lm)
        hidden = int(lm.config.hidden_size)
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.config = lm.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        h = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        return self.head(h.last_hidden_state).squeeze(-1).float()


class CriticWorker(_Worker):
    """PPO critic: values of the states before each response token, clipped value-loss updates."""

    def __init__(
        self,
        model_path: str,
        *,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        device: str | torch.device | None = None,
        bf16: bool | None = None,
        micro_batch_size: int = 8,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(device=device, bf16=bf16, micro_batch_size=micro_batch_size)
        self.optim_cfg = optim or OptimConfig(lr=1e-5)
        self.loss_cfg = loss or LossConfig()
        lm = load_causal_lm(model_path, device=self.device, config_overrides=config_overrides)
        self.model = self._wrap(ValueModel(lm).to(self.device))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.optim_cfg.lr, weight_decay=self.optim_cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.optim_cfg))

    def _values(self, mb: Batch) -> Tensor:
        v = self.model(mb.input_ids, mb.attention_mask, mb.position_ids)
        p, t = mb.prompt_width, mb.responses.shape[1]
        return v[:, p - 1 : p - 1 + t] * mb.response_mask

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Tensor:
        out = []
        self.model.eval()
        for mb in micro_batches(batch, self.micro_batch_size):
            mb = mb.to(self.device)
            with self.autocast():
                out.append(self._values(mb).float().cpu())
        return torch.cat(out)

    def update(self, batch: Batch, num_mini_batches: int, epochs: int = 1) -> dict[str, float]:
        """Clipped value regression onto ``extras['returns']`` (old values in ``extras['values']``)."""
        sums: dict[str, float] = {}
        count = 0
        rows = batch.size
        per_mini = max(rows // num_mini_batches, 1)
        self.model.train()
        for _ in range(epochs):
            for start in range(0, rows, per_mini):
                mini = batch.select(list(range(start, min(start + per_mini, rows))))
                g_tokens = float(mini.response_mask.sum().item())
                self.optimizer.zero_grad(set_to_none=True)
                vl_total, vclip = 0.0, 0.0
                for mb in micro_batches(mini, self.micro_batch_size):
                    mb = mb.to(self.device)
                    with self.autocast():
                        v = self._values(mb).float()
                    loss, m = value_loss(
                        v,
                        mb.extras["values"],
                        mb.extras["returns"],
                        mb.response_mask,
                        self.loss_cfg.value_clip,
                        "token-mean",
                        global_tokens=g_tokens,
                    )
                    loss.backward()
                    vl_total += float(loss.detach())
                    vclip += float(m.clip_frac) * float(mb.response_mask.sum()) / max(g_tokens, 1.0)
                norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.optim_cfg.grad_clip or float("inf")
                )
                self.optimizer.step()
                for k, val in (
                    ("critic/vf_loss", vl_total),
                    ("critic/vf_clip_frac", vclip),
                    ("critic/grad_norm", float(norm)),
                ):
                    sums[k] = sums.get(k, 0.0) + val
                count += 1
        self.model.eval()
        return {k: v / max(count, 1) for k, v in sums.items()}

    def lr_step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
