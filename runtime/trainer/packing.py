"""Micro-batches chosen by tokens, each cut to its own widest prompt and response.

A rollout batch is padded to its longest prompt plus its longest response (``trainer.batch``); with
RL's spread of lengths (responses of 32-1,024 tokens) that is ~40% padding, and the update's
forward and backward pay for every padded position. Grouping rows of similar length into
micro-batches of at most ``max_tokens`` padded tokens, and cutting each micro-batch's columns to
its own rows, leaves a few percent. The loss is unchanged: every micro-batch's loss is normalised
by the whole mini-batch's token (or sequence) count, so the accumulated gradient does not depend on
how rows are grouped (``actor`` docstring).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlkube.runtime.trainer.batch import Batch


def row_lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Real prompt and response length of every row."""
    plen = batch.attention_mask[:, : batch.prompt_width].sum(1)
    rlen = batch.response_mask.sum(1)
    return [int(x) for x in plen.tolist()], [int(x) for x in rlen.tolist()]


def token_micro_batches(
    prompt_lens: Sequence[int], response_lens: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """Row indices in groups whose padded size (rows x (widest prompt + widest response)) stays
    within ``max_tokens``; a row longer than that on its own gets its own group.

    Rows are taken longest first, so each group holds rows of similar length. Deterministic.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError("one prompt length and one response length per row")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(prompt_lens)), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    groups: list[list[int]] = []
    cur: list[int] = []
    wp = wr = 0
    for i in order:
        np_, nr = max(wp, prompt_lens[i]), max(wr, response_lens[i])
        if cur and (len(cur) + 1) * (np_ + nr) > max_tokens:
            groups.append(cur)
            cur, np_, nr = [], prompt_lens[i], response_lens[i]
        cur.append(i)
        wp, wr = np_, nr
    if cur:
        groups.append(cur)
    return groups


def padded_tokens(
    prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[Sequence[int]]
) -> int:
    """Positions the forward pass computes for these groups (padding included)."""
    return sum(
        len(g) * (max(prompt_lens[i] for i in g) + max(max(response_lens[i] for i in g), 1)) for g in groups
    )


def trim_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """The rows ``rows`` of ``batch`` with columns cut to their own widest prompt and response.

    The layout is kept (left-padded prompts ending at the new ``prompt_width``, responses after
    it), so everything that reads a :class:`Batch` reads this one; per-token extras ``[B, T]`` are
    cut to the new response width, per-row extras are kept.
    """
    sub = batch.select(list(rows))
    p_old, t_old = batch.prompt_width, batch.responses.shape[1]
    plens, rlens = row_lengths(sub)
    p_new, t_new = max(plens), max(max(rlens), 1)
    cols = slice(p_old - p_new, p_old + t_new)

    def cut(v: Tensor) -> Tensor:
        return v[:, :t_new] if v.dim() == 2 and v.shape[1] == t_old else v

    return Batch(
        input_ids=sub.input_ids[:, cols],
        attention_mask=sub.attention_mask[:, cols],
        position_ids=sub.position_ids[:, cols],
        responses=sub.responses[:, :t_new],
        response_mask=sub.response_mask[:, :t_new],
        prompt_width=p_new,
        scores=sub.scores,
        group_index=sub.group_index,
        extras={k: cut(v) for k, v in sub.extras.items()},
    )


def scatter_rows(out: Tensor, rows: Sequence[int], part: Tensor) -> None:
    """Write a trimmed micro-batch's per-token result ``part`` [b, t] back into ``out`` [B, T]."""
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=out.device)
    out[idx, : part.shape[1]] = part.to(out.dtype)
