"""Log-probabilities and entropy of chosen tokens straight from hidden states, a chunk at a time.

The usual path materialises ``logits = hidden @ W.T`` for every response token in float32,
``[tokens, vocab]``: for 16 sequences of 256 tokens and Qwen2.5's 151,936-token vocabulary that
is 2.5 GB, kept for the backward pass, plus as much again per softmax-shaped temporary. Here the
LM head, the log-softmax and the entropy run over ``chunk_tokens`` tokens at a time and only
``[tokens]`` results (and one log-sum-exp per token) are kept; the backward pass recomputes each
chunk's logits and forms the gradient in closed form:

- ``logp_t = z_t[y_t] - lse(z_t)``, so ``d logp_t / d z_t = onehot(y_t) - softmax(z_t)``;
- ``H_t = lse(z_t) - sum softmax(z_t) z_t``, so ``d H_t / d z_t = softmax(z_t) (E[z_t] - z_t)``;
- ``z_t = (h_t @ W.T) / T``: ``dL/dh = (dL/dz / T) @ W`` and ``dL/dW = (dL/dz / T).T @ h``.

The cost is one more LM-head matmul per token (the recomputation); the memory of the logits goes
from ``O(tokens x vocab)`` to ``O(chunk_tokens x vocab)``. Tested against the full-logits path
(values and gradients) in ``tests/trainer/test_logprob_packing.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _ChunkedHeadLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        inv_temp: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        w = weight.to(hidden.dtype)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = (hidden[s:e] @ w.t()).float()
            if inv_temp != 1.0:
                z = z * inv_temp
            lse = torch.logsumexp(z, dim=-1)
            logp[s:e] = z.gather(1, targets[s:e, None])[:, 0] - lse
            if with_entropy:
                ent[s:e] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
            lse_all[s:e] = lse
        ctx.save_for_backward(hidden, weight, targets, lse_all, ent)
        ctx.inv_temp, ctx.chunk, ctx.with_entropy = inv_temp, chunk, with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, lse_all, ent = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk
        use_ent = ctx.with_entropy and g_ent is not None
        n = hidden.shape[0]
        w = weight.to(hidden.dtype)
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = (hidden[s:e] @ w.t()).float()
            if inv_temp != 1.0:
                z = z * inv_temp
            p = torch.exp(z - lse_all[s:e, None])
            gz = torch.zeros_like(z)
            if g_logp is not None:
                gl = g_logp[s:e].float()
                gz = gz - p * gl[:, None]
                gz.scatter_add_(1, targets[s:e, None], gl[:, None])
            if use_ent:
                assert g_ent is not None
                mean_z = lse_all[s:e] - ent[s:e]  # E_p[z] = lse - H
                gz = gz + g_ent[s:e, None].float() * p * (mean_z[:, None] - z)
            if inv_temp != 1.0:
                gz = gz * inv_temp
            gzc = gz.to(hidden.dtype)
            if g_hidden is not None:
                g_hidden[s:e] = gzc @ w
            if g_weight is not None:
                g_weight += (gzc.t() @ hidden[s:e]).float()
        return g_hidden, (g_weight.to(weight.dtype) if g_weight is not None else None), None, None, None, None


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, Tensor | None]:
    """``log_softmax(hidden @ weight.T / T)[targets]`` (and the entropy) per token, float32.

    ``hidden`` ``[..., H]`` (the model's final-norm output at the positions that predict
    ``targets`` ``[...]``), ``weight`` the LM head ``[V, H]`` (a tied embedding is fine: its gradient
    accumulates). Never holds more than ``chunk_tokens x V`` logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree")
    lead = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    logp, ent = _ChunkedHeadLogprob.apply(
        flat_h, weight, flat_t, 1.0 / temperature, max(1, int(chunk_tokens)), with_entropy
    )
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)
