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


def split_to_count(groups: Sequence[Sequence[int]], count: int) -> tuple[list[list[int]], int]:
    """``groups`` split until there are ``count`` of them, and how many stand-in passes are still
    needed (when every group is down to one row).

    FSDP2 ranks gather and reduce parameters in every forward and backward pass, so every rank must
    run as many passes: a rank whose rows fit in fewer groups halves its largest groups (rows keep
    their length order) and, only if it has fewer rows than ``count``, runs stand-in passes whose
    loss is multiplied by zero.
    """
    out = [list(g) for g in groups]
    if count < len(out):
        raise ValueError(f"cannot merge {len(out)} groups into {count}")
    while len(out) < count:
        i = max(range(len(out)), key=lambda j: (len(out[j]), -j))
        g = out[i]
        if len(g) < 2:
            break
        half = len(g) // 2
        out[i : i + 1] = [g[:half], g[half:]]
    return out, count - len(out)


def padded_tokens(
    prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[Sequence[int]]
) -> int:
    """Positions the forward pass computes for these groups (padding included)."""
    return sum(
        len(g) * (max(prompt_lens[i] for i in g) + max(max(response_lens[i] for i in g), 1)) for g in groups
    )


def group_widths(
    prompt_lens: Sequence[int], response_lens: Sequence[int], rows: Sequence[int]
) -> tuple[int, int]:
    """The widest prompt and the widest response (at least 1) among ``rows``."""
    return max(prompt_lens[i] for i in rows), max(max(response_lens[i] for i in rows), 1)


def cut_rows(batch: Batch, index: Tensor, prompt_width: int, response_width: int) -> Batch:
    """Rows ``index`` (a tensor on ``batch``'s device) with columns cut to the given widths.

    The layout is kept (left-padded prompts ending at the new ``prompt_width``, responses after
    it), so everything that reads a :class:`Batch` reads this one; per-token extras ``[B, T]`` are
    cut to the new response width, per-row extras are kept. On a GPU the gathers are only queued:
    the widths come from the host, so nothing waits for the device.
    """
    p_old, t_old = batch.prompt_width, batch.responses.shape[1]
    cols = slice(p_old - prompt_width, p_old + response_width)

    def rows_of(v: Tensor) -> Tensor:
        v = v.index_select(0, index)
        return v[:, :response_width] if v.dim() == 2 and v.shape[1] == t_old else v

    return Batch(
        input_ids=batch.input_ids.index_select(0, index)[:, cols],
        attention_mask=batch.attention_mask.index_select(0, index)[:, cols],
        position_ids=batch.position_ids.index_select(0, index)[:, cols],
        responses=batch.responses.index_select(0, index)[:, :response_width],
        response_mask=batch.response_mask.index_select(0, index)[:, :response_width],
        prompt_width=prompt_width,
        scores=batch.scores.index_select(0, index),
        group_index=batch.group_index.index_select(0, index),
        extras={k: rows_of(v) for k, v in batch.extras.items()},
    )


def trim_rows(batch: Batch, rows: Sequence[int]) -> Batch:
    """The rows ``rows`` of a host ``batch`` cut to their own widest prompt and response."""
    plens, rlens = row_lengths(batch)
    index = torch.as_tensor(list(rows), dtype=torch.long)
    return cut_rows(batch, index, *group_widths(plens, rlens, rows))


def scatter_rows(out: Tensor, rows: Sequence[int], part: Tensor) -> None:
    """Write a trimmed micro-batch's per-token result ``part`` [b, t] back into ``out`` [B, T]."""
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=out.device)
    out[idx, : part.shape[1]] = part.to(out.dtype)
