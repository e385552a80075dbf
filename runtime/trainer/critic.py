"""The PPO critic: the policy's transformer body with a zero-initialised scalar value head."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rlkube.runtime.algos import value_loss
from rlkube.runtime.trainer.batch import Batch
from rlkube.runtime.trainer.modeling import load_causal_lm
from rlkube.runtime.trainer.worker import LossConfig, OptimConfig, TrainWorker, lr_lambda, scatter_pass


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


class CriticWorker(TrainWorker):
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
        micro_batch_tokens: int = 0,
        replicate: int = 1,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            device=device,
            bf16=bf16,
            micro_batch_size=micro_batch_size,
            replicate=replicate,
            micro_batch_tokens=micro_batch_tokens,
        )
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
        out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=self.device)
        self.model.eval()
        with self.autocast():
            for plan in self.plan_micro_batches(batch):
                values = self._values(plan.batch).float()
                if not plan.stand_in:
                    scatter_pass(out, plan, values)
        return out.cpu()

    def update(self, batch: Batch, num_mini_batches: int, epochs: int = 1) -> dict[str, float]:
        """Clipped value regression onto ``extras['returns']`` (old values in ``extras['values']``)."""
        sums: dict[str, float] = {}
        count = 0
        rows = batch.size
        per_mini = max(rows // num_mini_batches, 1)
        self.model.train()
        for _ in range(epochs):
            for start in range(0, rows, per_mini):
                mini = batch.rows(start, min(start + per_mini, rows))  # views: read only
                g_tokens, _ = self.global_counts(mini)
                local_tokens = float(mini.response_mask.sum())
                self.optimizer.zero_grad(set_to_none=True)
                vl_total = torch.zeros((), dtype=torch.float64, device=self.device)
                vclip = torch.zeros((), dtype=torch.float64, device=self.device)
                for plan in self.plan_micro_batches(mini):
                    mb = plan.batch
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
                    if plan.stand_in:  # keeps this rank's collectives in step; adds nothing
                        (loss * 0.0).backward()
                        continue
                    loss.backward()
                    vl_total += loss.detach().double()
                    vclip += (
                        m.clip_frac.detach().double() * float(mb.response_mask.sum()) / max(local_tokens, 1.0)
                    )
                norm = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(), self.optim_cfg.grad_clip or float("inf")
                )
                if hasattr(norm, "full_tensor"):
                    norm = norm.full_tensor()
                self.optimizer.step()
                stats = self.reduce_metrics(
                    {"critic/vf_loss": vl_total}, {"critic/vf_clip_frac": vclip}, local_tokens
                )
                stats["critic/grad_norm"] = float(norm)
                for k, val in stats.items():
                    sums[k] = sums.get(k, 0.0) + val
                count += 1
        self.model.eval()
        return {k: v / max(count, 1) for k, v in sums.items()}

    def lr_step(self) -> None:
        self.scheduler.step()
