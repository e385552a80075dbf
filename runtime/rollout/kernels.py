"""Decode kernels for the hf engine: attention over each row's own KV length, one-pass sampling.

Three operations, each with a plain PyTorch reference (the CPU path, and the fallback wherever
Triton is missing or its self-check fails) and a Triton kernel (CUDA/ROCm): the two below, and
``silu_mul``, the MLP's ``silu(gate) * up`` (inductor's fused kernel for it ran at a third of
bandwidth on the 1.5B shape).

- ``rope_attention``: from the q/k/v projection's output, RoPE on q and the new k, the new k and v
  written into the cache at the row's position, and attention of that one query token per row
  (GQA: the query heads of one KV head are processed together) over the row's own positions up to
  and including it. The Triton kernel splits each row's KV range into fixed chunks
  (flash-decoding; one chunk, and no combine kernel, when that already fills the GPU) and skips
  chunks past the row's length, so a batch of mixed lengths reads only the KV it needs and the KV
  length is not a shape: one CUDA graph serves every length. Doing RoPE and the cache write here
  saves the three or four small kernels per layer they cost on their own.
- ``sample_tokens``: Gumbel-max sampling, ``argmax(logits / T + g)`` with ``g = -log(-log(u))``,
  which draws exactly from ``softmax(logits / T)``; the uniforms ``u`` are a hash of (row seed,
  vocabulary index), so a seeded sample is reproducible whatever shares the batch and on any
  device. The kernel reads the logits once and returns the token and its raw log-probability
  ``log_softmax(logits)[token]`` (before temperature), where inverse-CDF sampling needs a softmax,
  a cumulative sum, a search and a separate log-softmax pass over the vocabulary. The noise (a
  hash and two logs per element, most of the kernel's work) is skipped for a block whose largest
  ``logit / T`` plus the largest possible noise cannot reach the best score found so far, and the
  two logs for a block where no element's hash leaves it a chance (``1 - u`` bounds ``-log(u)``
  from below); both exact, and past the first blocks of a chunk most of the vocabulary.
  ``sample_tokens_cdf_ref`` (and ``TritonSampler(method="cdf")``, the engine's default since it
  was 2.5x faster on an H100) draws by inverse CDF instead: one uniform per row, block sums of
  ``CDF_BLOCK`` entries in one pass with one exponential per entry, then one block per row read
  again; no per-entry hash.

Row seeds come from ``row_seeds(key, counter)``: the counter is the token's index in its sample.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

_M32 = 0xFFFFFFFF
# Above every Gumbel noise value gumbel_noise can give: its largest uniform is 1 - 2**-24, whose noise
# is -log(-log(1 - 2**-24)) = 24 ln 2 = 16.64 (float32 rounding adds ~1e-6). The sampling kernel
# skips a block of the vocabulary whose largest logit / T plus this cannot reach the best score yet.
GUMBEL_BOUND = 17.0
_GOLDEN = 0x9E3779B9
_VOCAB_MIX = 0x85EBCA77


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding 32-bit values (wrapping multiply, masked)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def row_seeds(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """32-bit seed per row (int64 tensor) from a 62-bit sample key and the token counter."""
    a = fmix32((keys & _M32) ^ ((counters * _GOLDEN) & _M32))
    return fmix32((a + 0x68E31DA4 + (keys >> 32)) & _M32)


def gumbel_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` float32 Gumbel noise from the per-element hash (the kernel computes the same)."""
    v = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    h = fmix32(seeds[:, None] ^ ((v[None] * _VOCAB_MIX) & _M32))
    # 23 random bits: k + 0.5 (k < 2**23) is exact in float32, so u lies in [2**-24, 1 - 2**-24].
    # With 24 bits the top value 2**24 - 0.5 rounds to 2**24, u == 1.0 and the noise is +inf: one
    # element in 2**24 (about one token in a hundred over a 152k vocabulary) would win whatever
    # its probability.
    return -torch.log(-torch.log(_uniform23(h)))


def _uniform23(h: torch.Tensor) -> torch.Tensor:
    """``(k + 0.5) / 2**23`` from the top 23 bits ``k`` of 32-bit hashes: exact in float32, in (0, 1)."""
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def sample_tokens_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max sample per row of ``logits`` [N, V]; returns (token int64, raw logprob float32).

    ``temperature <= 0`` is greedy (first maximum). ``keep`` (bool [N, V]) restricts the choice
    to a nucleus (top-p); the log-probability stays the raw one over the whole vocabulary.
    """
    x = logits.float()
    greedy = temperature <= 0
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature.clamp_min(1e-30))
    score = torch.where(greedy[:, None], x, x * inv_t[:, None] + gumbel_noise(seeds, x.shape[-1]))
    if keep is not None:
        score = score.masked_fill(~keep, float("-inf"))
    tok = score.argmax(-1)
    lp = x.gather(1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)
    return tok, lp


def top_p_keep(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool [N, V]: the smallest set of most likely tokens (under ``logits / T``) whose mass reaches top_p."""
    t = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    sp, order = probs.sort(dim=-1, descending=True)
    drop_sorted = (sp.cumsum(-1) - sp) > top_p[:, None]  # mass before this token already reaches top_p
    drop_sorted[:, 0] = False
    return ~torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)


# Inverse-CDF sampling (``sample_tokens_cdf_ref``) sums the vocabulary in blocks of this many entries,
# whatever the kernel's launch: the block sums, and so the token a seed draws, do not depend on
# how many rows share the batch.
CDF_BLOCK = 512
_CDF_SALT = 0x2545F491


def cdf_uniform(seeds: torch.Tensor) -> torch.Tensor:
    """One float32 uniform in (0, 1) per row seed, from 23 bits of a hash (``gumbel_noise`` says why 23)."""
    return _uniform23(fmix32(seeds ^ _CDF_SALT))


def sample_tokens_cdf_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sample per row of ``logits`` [N, V]: the same contract as ``sample_tokens_ref``.

    One uniform per row (``cdf_uniform``) against the cumulative mass of ``softmax(logits / T)``,
    found in two steps as the kernel does: the block of ``CDF_BLOCK`` entries where the cumulative
    block sums pass ``u * total``, then the entry inside it. Each block's sum is taken relative to
    its own maximum, so the weights need no second pass over the vocabulary; only the chosen block
    is read again. Rounding can leave ``u * total`` past the last sum: the last entry of nonzero
    mass is taken, so an impossible token never is.
    """
    x = logits.float()
    n, v = x.shape
    nb = -(-v // CDF_BLOCK)
    greedy = temperature <= 0
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature.clamp_min(1e-30))
    xs = x if keep is None else x.masked_fill(~keep, float("-inf"))
    blocks = F.pad(xs, (0, nb * CDF_BLOCK - v), value=float("-inf")).view(n, nb, CDF_BLOCK)
    mb = blocks.amax(-1)
    mb_safe = torch.where(mb == float("-inf"), torch.zeros_like(mb), mb)
    e = torch.exp((blocks - mb_safe[..., None]) * inv_t[:, None, None])
    mm = mb.amax(-1, keepdim=True)
    w = e.sum(-1) * torch.exp((mb - mm) * inv_t[:, None])
    idx_b = torch.arange(nb, device=x.device)
    target = cdf_uniform(seeds) * w.sum(-1)
    last_b = torch.where(w > 0, idx_b, -1).amax(-1)
    b = torch.minimum((w.cumsum(-1) <= target[:, None]).sum(-1), last_b)
    before = torch.where(idx_b < b[:, None], w, 0.0).sum(-1)
    scale = torch.exp((mb.gather(1, b[:, None])[:, 0] - mm[:, 0]) * inv_t)
    eb = e[torch.arange(n, device=x.device), b]
    idx_i = torch.arange(CDF_BLOCK, device=x.device)
    last_i = torch.where(eb > 0, idx_i, -1).amax(-1)
    i = torch.minimum((eb.cumsum(-1) <= ((target - before) / scale)[:, None]).sum(-1), last_i)
    tok = torch.where(greedy, xs.argmax(-1), b * CDF_BLOCK + i)
    lp = x.gather(1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)
    return tok, lp


# the sampling methods (``HFEngine(sampling=...)``): each reference; ``TritonSampler(method=...)``
# runs the same maths on GPUs
SAMPLE_REFS = {"gumbel": sample_tokens_ref, "cdf": sample_tokens_cdf_ref}
# the attention kernels' softmax is base 2: scores times log2(e), then exp2
LOG2E = math.log2(math.e)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``rotate_half(x) * sin == roll(x, D/2) * signed_sin``, three kernels, not six."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def rope_attention_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    n_heads: int,
    kv_len: int | None = None,
) -> torch.Tensor:
    """What ``TritonDecodeAttention.rope_attend`` computes, in PyTorch (the reference, and the decode
    step without the kernel): RoPE on q and k of the projection output ``qkv`` [B, (H + 2 Hkv) D]
    (``cos`` / ``signed_sin`` are the ``[S, D]`` tables of ``rope``), k and v written into the
    caches at each row's ``pos``, then attention over each row's positions up to and including
    ``pos``; returns [B, Hkv, G, D]. ``kv_len`` bounds the positions read (default ``max(pos) + 1``,
    which syncs with the host: a CUDA graph passes its KV bucket instead).
    """
    b, n_kv, d = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    nqk = n_heads + n_kv
    qk = qkv[:, : nqk * d].view(b, nqk, d)
    qk = rope(qk, cos[pos][:, None], signed_sin[pos][:, None])  # q and k are adjacent: one RoPE
    rows = torch.arange(b, device=qkv.device)
    k_cache[rows, :, pos] = qk[:, n_heads:]
    v_cache[rows, :, pos] = qkv[:, nqk * d :].view(b, n_kv, d)
    q = qk[:, :n_heads].reshape(b, n_kv, n_heads // n_kv, d)
    return decode_attention_ref(
        q, k_cache, v_cache, pos + 1, int(pos.max()) + 1 if kv_len is None else kv_len
    )


def decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_len: torch.Tensor, kv_len: int
) -> torch.Tensor:
    """SDPA over the first ``kv_len`` positions with each row masked to its ``seq_len``.

    ``q`` [B, Hkv, G, D] (the query heads of one KV head as its queries), caches [>=B, Hkv, S, D];
    returns [B, Hkv, G, D].
    """
    b = q.shape[0]
    visible = torch.arange(kv_len, device=q.device)[None] < seq_len[:, None]
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
    mask = mask.masked_fill(~visible, float("-inf"))[:, None, None]
    return F.scaled_dot_product_attention(q, k_cache[:b, :, :kv_len], v_cache[:b, :, :kv_len], attn_mask=mask)


def group_members_max(group: int) -> int:
    """Rows per program of the grouped attention kernel: as many as keep its query tile (rows x
    query heads per KV head) at 64 rows, at most 16."""
    return max(1, min(16, 64 // _next_pow2(group)))


def attention_groups(
    share_row: list[int], share_len: list[int], rows: int, members: int, block_n: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """The grouped attention kernel's table: rows that read one prompt copy, in groups of at most
    ``members``; every row in ``[0, rows)`` in exactly one group (a row that shares nothing, or
    that is past ``share_row``'s length, alone).

    ``share_row`` / ``share_len`` are ``StaticDecoder.set_shared_prompts``'s: row ``r`` reads
    positions below ``share_len[r]`` from row ``share_row[r]`` (its group's first row, whose own
    ``share_len`` is 0). Returns ``(groups, src, shared)``, one entry per group, ordered by first
    row (so a bucket of ``b`` rows finds all its groups among the first ``b``): the member rows,
    the row holding the group's prompt K/V, and the positions read from there (the followers'
    shortest shared length, down to a block), the same for all of a group's members.
    """
    followers: dict[int, list[int]] = {}
    for r, (src, n) in enumerate(zip(share_row, share_len, strict=True)):
        if n > 0 and src != r:
            followers.setdefault(src, []).append(r)
    led = {r for rs in followers.values() for r in rs}
    groups: list[list[int]] = []
    src_rows: list[int] = []
    shared: list[int] = []
    for r in range(rows):
        if r in led:
            continue
        rs = followers.get(r, [])
        end = min((share_len[f] for f in rs), default=0) // block_n * block_n
        whole = [r, *rs]
        for i in range(0, len(whole), members):
            groups.append(whole[i : i + members])
            src_rows.append(r)
            shared.append(end)
    return groups, src_rows, shared


def attention_group_tensors(
    share_row: list[int], share_len: list[int], rows: int, members: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_groups`` as the kernel reads it, ``rows`` entries (unused ones empty): member
    rows ``[rows, members]`` int32 (-1 padded), source row int64 and shared length int32 per group."""
    groups, src, shared = attention_groups(share_row, share_len, rows, members, block_n)
    pad = rows - len(groups)
    flat = [r for g in groups for r in (*g, *[-1] * (members - len(g)))]
    flat += [-1] * (pad * members)
    return (
        torch.tensor(flat, dtype=torch.int32).view(rows, members),
        torch.tensor(src + [0] * pad, dtype=torch.long),
        torch.tensor(shared + [0] * pad, dtype=torch.int32),
    )


# ---- Triton ---------------------------------------------------------------------------------
try:  # pragma: no cover - exercised on GPUs and, in interpreter mode, by the kernel tests
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

if HAVE_TRITON:
    _GUMBEL_BOUND = tl.constexpr(GUMBEL_BOUND)
    _STEP = tl.constexpr(2.0**-23)  # between the hash's uniforms (23 bits)
    _HALF_STEP = tl.constexpr(2.0**-24)
    _CDF_SALT_TL = tl.constexpr(_CDF_SALT)

    @triton.jit
    def _attend(q, k_own, v_own, k_src, v_src, start, shared_end, end, sk_s, sv_s, m_i, l_i, acc, scale,
                BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """Online-softmax attention of the queries ``q`` [G, D] over cached positions [start, end):
        those below ``shared_end`` (a block boundary) from ``k_src`` / ``v_src``, the rest from
        ``k_own`` / ``v_own``. One loop, so one set of pipeline buffers and registers. ``scale``
        includes log2(e): the running maxima and sums are in base 2 (``exp2``, one instruction)."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + offs_n
            nmask = n < end
            from_src = n0 < shared_end
            k_base = tl.where(from_src, k_src, k_own)
            v_base = tl.where(from_src, v_src, v_own)
            k = tl.load(k_base + n[:, None] * sk_s + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr branch inside a Triton kernel
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(nmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sv_s + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _finish(m_i, l_i, acc, b, h, sp, n_heads_kv, n_splits, G, O_PART, M_PART, L_PART, OUT, so_b, so_h,
                so_g, BLOCK_G: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr):  # fmt: skip
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        if DIRECT:  # one split covers every row: normalise here, no combine kernel
            ptr = OUT + b * so_b + h * so_h + offs_g[:, None] * so_g + offs_d[None, :]
            tl.store(ptr, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=(offs_g < G)[:, None])
        else:  # partials laid out [B, Hkv, n_splits, BLOCK_G(, D)], contiguous
            row = (b * n_heads_kv + h) * n_splits + sp
            tl.store(M_PART + row * BLOCK_G + offs_g, m_i)
            tl.store(L_PART + row * BLOCK_G + offs_g, l_i)
            tl.store(O_PART + (row * BLOCK_G + offs_g[:, None]) * D + offs_d[None, :], acc)

    @triton.jit
    def _rope_row(QKV, col0, c, s, D: tl.constexpr):
        """RoPE of the ``D`` values at ``QKV + col0`` (rotate-half; ``s`` is the signed sine), float32."""
        d = tl.arange(0, D)
        x = tl.load(QKV + col0 + d).to(tl.float32)
        x_p = tl.load(QKV + col0 + (d + D // 2) % D).to(tl.float32)
        return x * c + x_p * s

    @triton.jit
    def _rope_attn_split_kernel(
        QKV,
        COS,
        SIN,
        POS,
        SHARE_ROW,
        SHARE_LEN,
        K,
        V,
        O_PART,
        M_PART,
        L_PART,
        OUT,
        s_qkv,
        s_cs,
        sk_b,
        sk_h,
        sk_s,
        sv_b,
        sv_h,
        sv_s,
        so_b,
        so_h,
        so_g,
        n_splits,
        G,
        scale,
        N_HEADS: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
        IEEE: tl.constexpr,
        DIRECT: tl.constexpr,
        SHARE: tl.constexpr,
    ):
        """One (row, KV head, split) program: RoPE on q and the new k, the new k and v written at
        the row's position ``POS`` (by the split holding it), attention over the cached positions
        of the split before it plus, in that split, the new token from registers. With ``SHARE``,
        positions below ``SHARE_LEN`` (rounded down to a block) are read from row ``SHARE_ROW``,
        which holds the same prompt: a group's samples read their prompt's KV from one copy.

        The new token's k and v are loaded, rotated and stored before the loop, so their loads
        wait alongside the query's rather than after the last block (with the base-2 softmax:
        36.3 -> 34.8 us at 512 rows and context 192, 1.5B heads on an H100, cold caches;
        ``attention_variants_gpu.py --old-kernels``). ``scale`` is ``log2(e) / sqrt(D)``."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        n_kv = tl.num_programs(1)
        pos = tl.load(POS + b).to(tl.int32)
        start = sp * SPLIT
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        if start <= pos:
            row = QKV + b * s_qkv
            c = tl.load(COS + pos * s_cs + offs_d).to(tl.float32)
            sn = tl.load(SIN + pos * s_cs + offs_d).to(tl.float32)
            qcol = (h * G + offs_g[:, None]) * D  # query heads h*G .. h*G+G-1
            q = tl.load(row + qcol + offs_d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
            q_p = tl.load(row + qcol + (offs_d[None, :] + D // 2) % D, mask=gmask[:, None], other=0.0)
            q = (q * c[None, :] + q_p.to(tl.float32) * sn[None, :]).to(K.dtype.element_ty)
            # the new token (a few hundred bytes of the q/k/v row), stored by the split holding it
            holds_new = pos < start + SPLIT
            k_new = _rope_row(row, (N_HEADS + h) * D, c, sn, D).to(K.dtype.element_ty)
            v_new = tl.load(row + (N_HEADS + n_kv + h) * D + offs_d)
            new_mask = (offs_d < D) & holds_new
            tl.store(K + b * sk_b + h * sk_h + pos * sk_s + offs_d, k_new, mask=new_mask)
            tl.store(V + b * sv_b + h * sv_h + pos * sv_s + offs_d, v_new, mask=new_mask)
            end = tl.minimum(start + SPLIT, pos)
            k_own, v_own = K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h
            k_src, v_src, shared_end = k_own, v_own, start
            if SHARE:  # block-aligned, so the blocks and the sums are the same as reading the row's own copy
                src = tl.load(SHARE_ROW + b)
                k_src, v_src = K + src * sk_b + h * sk_h, V + src * sv_b + h * sv_h
                shared_end = tl.load(SHARE_LEN + b).to(tl.int32) // BLOCK_N * BLOCK_N
            m_i, l_i, acc = _attend(
                q, k_own, v_own, k_src, v_src, start, shared_end, end,
                sk_s, sv_s, m_i, l_i, acc, scale, BLOCK_N, D, IEEE,
            )  # fmt: skip
            if holds_new:  # attend to the new token, from registers
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
                m_new = tl.maximum(m_i, s_new)
                p = tl.exp2(s_new - m_new)
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + p
                acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
        _finish(
            m_i, l_i, acc, b, h, sp, n_kv, n_splits, G, O_PART, M_PART, L_PART, OUT, so_b, so_h, so_g,
            BLOCK_G, D, DIRECT,
        )  # fmt: skip

    @triton.jit
    def _attn_combine_kernel(
        O_PART,
        M_PART,
        L_PART,
        POS,
        OUT,
        so_b,
        so_h,
        so_g,
        n_splits,
        G,
        SPLIT: tl.constexpr,
        BLOCK_G: tl.constexpr,
        D: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        n_heads_kv = tl.num_programs(1)
        seq = tl.load(POS + b).to(tl.int32) + 1  # positions 0..pos
        used = tl.minimum((seq + SPLIT - 1) // SPLIT, n_splits)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        base = (b * n_heads_kv + h) * n_splits
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for sp in range(0, used):
            m = tl.maximum(m, tl.load(M_PART + (base + sp) * BLOCK_G + offs_g))
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for sp in range(0, used):  # the maxima are base 2 (the split kernel's exp2)
            w = tl.exp2(tl.load(M_PART + (base + sp) * BLOCK_G + offs_g) - m)
            denom += w * tl.load(L_PART + (base + sp) * BLOCK_G + offs_g)
            part = tl.load(O_PART + ((base + sp) * BLOCK_G + offs_g[:, None]) * D + offs_d[None, :])
            acc += w[:, None] * part
        out = acc / denom[:, None]
        gmask = offs_g < G
        ptr = OUT + b * so_b + h * so_h + offs_g[:, None] * so_g + offs_d[None, :]
        tl.store(ptr, out.to(OUT.dtype.element_ty), mask=gmask[:, None])

    @triton.jit
    def _grouped_rope_attn_kernel(
        QKV, COS, SIN, POS, GROUPS, GROUP_SRC, GROUP_SHARED, K, V, OUT,
        s_qkv, s_cs, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_g,
        n_rows, G, scale,
        N_HEADS: tl.constexpr, MEMBERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        D: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """One (group, KV head) program: the query heads of up to MEMBERS rows that read one prompt
        copy form one tile (query row i: member i // G, head i % G). The prompt's blocks are read
        once for all of them; then each member's own blocks, one loop over (member, block), the
        other members' rows masked out; then each member's new token (RoPE on q and k, the cache
        write) as in ``_rope_attn_split_kernel``. Every row sees the same blocks in the same order
        as there, so the sums are the same."""
        gi = tl.program_id(0)
        h = tl.program_id(1)
        n_kv = tl.num_programs(1)
        offs_mem = tl.arange(0, MEMBERS)
        mem_rows = tl.load(GROUPS + gi * MEMBERS + offs_mem)
        mem_ok = (mem_rows >= 0) & (mem_rows < n_rows)
        n_members = tl.sum(mem_ok.to(tl.int32), 0)
        if n_members > 0:  # members are a prefix of the table's row; an empty row is no group
            mem_rows = tl.where(mem_ok, mem_rows, 0)
            mem_end = tl.load(POS + mem_rows, mask=mem_ok, other=0).to(tl.int32)
            offs_i = tl.arange(0, BLOCK_M)
            mem_i = offs_i // G
            head_i = offs_i % G
            row_i = tl.load(GROUPS + gi * MEMBERS + mem_i, mask=mem_i < MEMBERS, other=-1)
            ok_i = (mem_i < MEMBERS) & (row_i >= 0) & (row_i < n_rows)
            row_i = tl.where(ok_i, row_i, 0)
            pos_i = tl.load(POS + row_i).to(tl.int32)
            offs_d = tl.arange(0, D)
            offs_n = tl.arange(0, BLOCK_N)
            rot = (offs_d + D // 2) % D
            c = tl.load(COS + pos_i[:, None] * s_cs + offs_d[None, :]).to(tl.float32)
            sn = tl.load(SIN + pos_i[:, None] * s_cs + offs_d[None, :]).to(tl.float32)
            q_ptr = QKV + row_i[:, None] * s_qkv + ((h * G + head_i) * D)[:, None]
            q = tl.load(q_ptr + offs_d[None, :], mask=ok_i[:, None], other=0.0).to(tl.float32)
            q_p = tl.load(q_ptr + rot[None, :], mask=ok_i[:, None], other=0.0).to(tl.float32)
            q = (q * c + q_p * sn).to(K.dtype.element_ty)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            src = tl.load(GROUP_SRC + gi)
            shared_end = tl.load(GROUP_SHARED + gi).to(tl.int32)
            k_src, v_src = K + src * sk_b + h * sk_h, V + src * sv_b + h * sv_h
            for n0 in range(0, shared_end, BLOCK_N):  # the prompt: whole blocks below every member's position
                n = n0 + offs_n
                k = tl.load(k_src + n[:, None] * sk_s + offs_d[None, :])
                if IEEE:  # noqa: SIM108 - a constexpr branch inside a Triton kernel
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = s * scale
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp(s - m_new[:, None])
                alpha = tl.exp(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_src + n[:, None] * sv_s + offs_d[None, :])
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            last = tl.max(tl.where(mem_ok, mem_end, 0), 0)
            n_blocks = tl.maximum(last - shared_end + BLOCK_N - 1, 0) // BLOCK_N
            for t in range(0, n_members * n_blocks):  # each member's own positions
                j = t // n_blocks
                n = shared_end + (t % n_blocks) * BLOCK_N + offs_n
                row_j = tl.sum(tl.where(offs_mem == j, mem_rows, 0), 0)
                end_j = tl.sum(tl.where(offs_mem == j, mem_end, 0), 0)
                nmask = n < end_j
                k = tl.load(K + row_j * sk_b + h * sk_h + n[:, None] * sk_s + offs_d[None, :],
                            mask=nmask[:, None], other=0.0)  # fmt: skip
                if IEEE:  # noqa: SIM108 - a constexpr branch inside a Triton kernel
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                s = tl.where((mem_i == j)[:, None] & nmask[None, :], s * scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + row_j * sv_b + h * sv_h + n[:, None] * sv_s + offs_d[None, :],
                            mask=nmask[:, None], other=0.0)  # fmt: skip
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            # each member's new token: its k (RoPE) and v, stored once per member, attended by its rows
            kn_ptr = QKV + row_i[:, None] * s_qkv + (N_HEADS + h) * D
            k_new = tl.load(kn_ptr + offs_d[None, :]).to(tl.float32) * c
            k_new = (k_new + tl.load(kn_ptr + rot[None, :]).to(tl.float32) * sn).to(K.dtype.element_ty)
            v_new = tl.load(QKV + row_i[:, None] * s_qkv + (N_HEADS + n_kv + h) * D + offs_d[None, :])
            first = (ok_i & (head_i == 0))[:, None]
            tl.store(K + row_i[:, None] * sk_b + h * sk_h + pos_i[:, None] * sk_s + offs_d[None, :], k_new,
                     mask=first)  # fmt: skip
            tl.store(V + row_i[:, None] * sv_b + h * sv_h + pos_i[:, None] * sv_s + offs_d[None, :], v_new,
                     mask=first)  # fmt: skip
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale
            m_new = tl.maximum(m_i, s_new)
            p = tl.exp(s_new - m_new)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
            ptr = OUT + row_i[:, None] * so_b + h * so_h + head_i[:, None] * so_g + offs_d[None, :]
            tl.store(ptr, (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=ok_i[:, None])

    @triton.jit
    def _fmix32_tl(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _chance(gap, x, inv_t, top, slack, greedy):
        """The screen per element: ``1 - u < exp(x / T - top + slack)`` (greedy rows: ``x > top``)."""
        return tl.where(greedy, x > top, gap < tl.exp(x * inv_t - top + slack))

    @triton.jit
    def _chance_unit_t(gap, e, c):
        """``_chance`` at temperature 1 from the log-sum-exp's ``e = exp(x - m)``: exp(x - top +
        slack) = e * exp(c), c = m - top + slack. Past c = 60 every element is let through: there
        a flushed e (x - m < -87) could hide a true value above the smallest gap (6e-8); below it
        such a value is < exp(-27)."""
        return gap < tl.where(c > 60.0, 2.0, e * tl.exp(tl.minimum(c, 60.0)))

    @triton.jit
    def _sample_split_kernel(
        X,
        sx,
        TEMP,
        SEEDS,
        P_M,
        P_S,
        P_BEST,
        P_IDX,
        P_RAW,
        V,
        n_splits,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        SCREEN: tl.constexpr,
        REUSE_EXP: tl.constexpr,
        BITCAST: tl.constexpr,
    ):
        r = tl.program_id(0)
        sp = tl.program_id(1)
        t = tl.load(TEMP + r)
        greedy = t <= 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(t, 1e-30))
        # REUSE_EXP: at temperature 1 (RL's usual) the screen's exp(x - top) is the sum's exp(x - m)
        # times one number per block (one exp per element instead of two; off by default, see the
        # class)
        unit_t = t == 1.0
        seed = tl.load(SEEDS + r).to(tl.uint32)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # running max of the chunk
        s = tl.zeros([BLOCK], tl.float32)  # per lane: sum of exp(x - m), reduced once at the end
        top = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # best score so far
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        bidx = tl.zeros([BLOCK], tl.int32)
        braw = tl.zeros([BLOCK], tl.float32)
        start = sp * CHUNK
        end = tl.minimum(start + CHUNK, V)
        for v0 in range(start, end, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            mask = v < end
            x = tl.load(X + r * sx + v, mask=mask, other=float("-inf")).to(tl.float32)
            # online logsumexp, one exp per element (a chunk of -inf so far adds nothing)
            xmax = tl.max(x, 0)
            m_new = tl.maximum(m, xmax)
            e = tl.exp(x - m_new)
            s = tl.where(m_new > float("-inf"), s * tl.exp(m - m_new) + e, 0.0)
            m = m_new
            # No score in this block can reach the best so far when even its largest logit plus the
            # largest noise falls short: skip the hash and the two logs (exact, see GUMBEL_BOUND).
            if xmax * inv_t + tl.where(greedy, 0.0, _GUMBEL_BOUND) >= top:
                k = _fmix32_tl(seed ^ (v.to(tl.uint32) * 0x85EBCA77)) >> 9
                # BITCAST: f = 1 + k / 2**23 exactly, k's 23 bits put under float32's exponent of 1
                # (an OR instead of an int-to-float conversion, a quarter-rate instruction)
                f = (k | 0x3F800000).to(tl.float32, bitcast=True) if BITCAST else k.to(tl.float32)
                if SCREEN:
                    # x/T - log(E) beats ``top`` only if E = -log(u) < exp(x/T - top), and
                    # E >= 1 - u: so an element with 1 - u >= exp(x/T - top) cannot win (no log
                    # needed). 1 - u is exact in float32; the slack covers the rounding of the
                    # scores and of exp. Greedy rows need x > top.
                    # (2**23 - 0.5 - k) / 2**23 either way, exactly
                    gap = (2.0 - f) - _HALF_STEP if BITCAST else (8388607.5 - f) * _STEP
                    slack = 1e-3 + 4e-6 * tl.abs(top)
                    if REUSE_EXP == 2:  # every row at temperature 1 (the caller's promise)
                        chance = _chance_unit_t(gap, e, m_new - top + slack)
                    elif REUSE_EXP == 1:
                        if unit_t:
                            chance = _chance_unit_t(gap, e, m_new - top + slack)
                        else:
                            chance = _chance(gap, x, inv_t, top, slack, greedy)
                    else:
                        chance = _chance(gap, x, inv_t, top, slack, greedy)
                    go = tl.max(chance.to(tl.int32), 0) > 0
                else:
                    go = xmax > float("-inf")
                if go:
                    # (k + 0.5) / 2**23 either way, exactly, as gumbel_noise
                    u = (f - 1.0) + _HALF_STEP if BITCAST else (f + 0.5) * _STEP
                    g = -tl.log(-tl.log(u))
                    score = tl.where(greedy, x, x * inv_t + g)
                    score = tl.where(mask, score, float("-inf"))
                    better = score > best
                    best = tl.where(better, score, best)
                    bidx = tl.where(better, v, bidx)
                    braw = tl.where(better, x, braw)
                    top = tl.max(best, 0)
        # reduce the lanes: the first index of the best score
        big = 2147483647
        idx = tl.min(tl.where(best == top, bidx, big), 0)
        raw = tl.max(tl.where((best == top) & (bidx == idx), braw, float("-inf")), 0)
        o = r * n_splits + sp
        tl.store(P_M + o, m)
        tl.store(P_S + o, tl.sum(s, 0))
        tl.store(P_BEST + o, top)
        tl.store(P_IDX + o, idx)
        tl.store(P_RAW + o, raw)

    @triton.jit
    def _sample_combine_kernel(P_M, P_S, P_BEST, P_IDX, P_RAW, TOK, LP, n_splits, BLOCK_S: tl.constexpr):
        r = tl.program_id(0)
        offs = tl.arange(0, BLOCK_S)
        mask = offs < n_splits
        o = r * n_splits + offs
        m = tl.load(P_M + o, mask=mask, other=float("-inf"))
        s = tl.load(P_S + o, mask=mask, other=0.0)
        best = tl.load(P_BEST + o, mask=mask, other=float("-inf"))
        idx = tl.load(P_IDX + o, mask=mask, other=2147483647)
        raw = tl.load(P_RAW + o, mask=mask, other=float("-inf"))
        mm = tl.max(m, 0)
        total = tl.sum(tl.where(mask, s * tl.exp(m - mm), 0.0), 0)
        top = tl.max(best, 0)
        tok = tl.min(tl.where(best == top, idx, 2147483647), 0)
        x = tl.max(tl.where((best == top) & (idx == tok), raw, float("-inf")), 0)
        tl.store(TOK + r, tok.to(tl.int64))
        tl.store(LP + r, x - mm - tl.log(total))

    @triton.jit
    def _cdf_blocks_kernel(X, sx, TEMP, P_M, P_S, P_T, V, NB, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Per ``BLOCK`` entries of one chunk of a row: the largest logit ``m``, ``sum exp(x - m)``
        (the log-probability's) and ``sum exp((x - m) / T)`` (the sampling weight's; the same sum
        at temperature 1 and for greedy rows, so one exponential per entry there)."""
        r = tl.program_id(0)
        start = tl.program_id(1) * CHUNK
        end = tl.minimum(start + CHUNK, V)
        t = tl.load(TEMP + r)
        inv_t = 1.0 / tl.maximum(t, 1e-30)
        o = r * NB + start // BLOCK
        if (t == 1.0) | (t <= 0.0):
            for v0 in range(start, end, BLOCK):
                v = v0 + tl.arange(0, BLOCK)
                x = tl.load(X + r * sx + v, mask=v < end, other=float("-inf")).to(tl.float32)
                mb = tl.max(x, 0)
                s = tl.sum(tl.exp(x - tl.where(mb == float("-inf"), 0.0, mb)), 0)
                tl.store(P_M + o, mb)
                tl.store(P_S + o, s)
                tl.store(P_T + o, s)
                o += 1
        else:
            for v0 in range(start, end, BLOCK):
                v = v0 + tl.arange(0, BLOCK)
                x = tl.load(X + r * sx + v, mask=v < end, other=float("-inf")).to(tl.float32)
                mb = tl.max(x, 0)
                d = x - tl.where(mb == float("-inf"), 0.0, mb)
                tl.store(P_M + o, mb)
                tl.store(P_S + o, tl.sum(tl.exp(d), 0))
                tl.store(P_T + o, tl.sum(tl.exp(d * inv_t), 0))
                o += 1

    @triton.jit
    def _cdf_pick_kernel(
        X, sx, TEMP, SEEDS, P_M, P_S, P_T, TOK, LP, V, NB, BLOCK_NB: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One row: the log-sum-exp from the block sums, the block where the cumulative sampling
        weight passes ``u * total``, then the entry inside it (``sample_tokens_cdf_ref``'s maths)."""
        r = tl.program_id(0)
        t = tl.load(TEMP + r)
        greedy = t <= 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.maximum(t, 1e-30))
        nb = tl.arange(0, BLOCK_NB)
        m = tl.load(P_M + r * NB + nb, mask=nb < NB, other=float("-inf"))
        s = tl.load(P_S + r * NB + nb, mask=nb < NB, other=0.0)
        st = tl.load(P_T + r * NB + nb, mask=nb < NB, other=0.0)
        mm = tl.max(m, 0)
        lse = mm + tl.log(tl.sum(s * tl.exp(m - mm), 0))
        w = st * tl.exp((m - mm) * inv_t)
        k = _fmix32_tl(tl.load(SEEDS + r).to(tl.uint32) ^ _CDF_SALT_TL) >> 9
        target = (k.to(tl.float32) + 0.5) * _STEP * tl.sum(w, 0)
        big = 2147483647
        last_b = tl.max(tl.where(w > 0.0, nb, -1), 0)
        b = tl.minimum(tl.sum((tl.cumsum(w, 0) <= target).to(tl.int32), 0), last_b)
        b = tl.where(greedy, tl.min(tl.where(m == mm, nb, big), 0), b)
        before = tl.sum(tl.where(nb < b, w, 0.0), 0)
        mb = tl.max(tl.where(nb == b, m, float("-inf")), 0)
        scale = tl.exp((mb - mm) * inv_t)
        v = b * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + r * sx + v, mask=v < V, other=float("-inf")).to(tl.float32)
        e = tl.exp((x - tl.where(mb == float("-inf"), 0.0, mb)) * inv_t)
        last_i = tl.max(tl.where(e > 0.0, v, -1), 0)
        inside = tl.sum((tl.cumsum(e, 0) <= (target - before) / scale).to(tl.int32), 0)
        tok = tl.minimum(b * BLOCK + inside, last_i)
        tok = tl.where(greedy, tl.min(tl.where(x == mm, v, big), 0), tok)
        tl.store(TOK + r, tok.to(tl.int64))
        tl.store(LP + r, tl.sum(tl.where(v == tok, x, 0.0), 0) - lse)

    @triton.jit
    def _silu_mul_kernel(
        GU, X, OUT, n_cols, h, eps, s_gu, s_x, s_out,
        BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, SCALED: tl.constexpr,
    ):  # fmt: skip
        """``silu(gate) * up`` of one row's [gate | up] block, in float32, rounded once; with
        ``SCALED``, gate and up first times ``s = 1 / rms`` of the row's residual ``X``, read here."""
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < n_cols
        g = tl.load(GU + r * s_gu + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + r * s_gu + n_cols + c, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            k = tl.arange(0, BLOCK_H)
            xr = tl.load(X + r * s_x + k, mask=k < h, other=0.0).to(tl.float32)
            s = 1.0 / tl.sqrt(tl.sum(xr * xr, 0) / h + eps)
            g, u = g * s, u * s
        tl.store(OUT + r * s_out + c, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=mask)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up projection's output [B, 2 I] (gate first)."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu_mul_ref`` as one Triton kernel over rows x column blocks (no index division; the
    decode-step benchmark's A/B against inductor's fused kernel)."""
    return _launch_silu_mul(gate_up, None, 0.0, block)


def _launch_silu_mul(gate_up: torch.Tensor, x: torch.Tensor | None, eps: float, block: int) -> torch.Tensor:
    """``_silu_mul_kernel`` over rows x column blocks; scaled by each row's ``1 / rms(x)`` when
    ``x`` is given."""
    b, n = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] == 2 * n
    assert x is None or (x.stride(-1) == 1 and x.shape[0] == b)
    out = torch.empty((b, n), dtype=gate_up.dtype, device=gate_up.device)
    res = gate_up if x is None else x  # unread unless scaled
    _silu_mul_kernel[(b, triton.cdiv(n, block))](
        gate_up, res, out, n, res.shape[1], eps, gate_up.stride(0), res.stride(0), out.stride(0),
        BLOCK=block, BLOCK_H=_next_pow2(res.shape[1]) if x is not None else 1, SCALED=x is not None,
    )  # fmt: skip
    return out


def scaled_silu_mul_ref(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """The gated MLP's input when the norm's weight is folded into the gate/up weight
    (``fold_norm_weight``) and the GEMM ran on the raw residual ``x`` [B, H]: each row's
    ``1 / rms(x)`` is the norm's missing factor, applied to gate and up before ``silu(g) * u``."""
    s = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return silu_mul_ref(gate_up.float() * s).to(gate_up.dtype)


def scaled_silu_mul(gate_up: torch.Tensor, x: torch.Tensor, eps: float, block: int = 1024) -> torch.Tensor:
    """``scaled_silu_mul_ref`` as the SiLU kernel scaled: the row's residual is read by every
    program of the row (a few KB from L2), so the norm needs no kernel of its own."""
    return _launch_silu_mul(gate_up, x, eps, block)


def fold_norm_weight(
    weight: torch.Tensor, norm: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * norm`` over the input columns: ``norm(x) @ W.T == (x / rms(x)) @ (W * norm).T``,
    so a GEMM on the folded weight needs only the per-row ``1 / rms`` afterwards. Into ``out``
    (in place, the address a captured graph holds) when given."""
    folded = weight.float() * norm.float()[None, :]
    if out is None:
        return folded.to(weight.dtype)
    return out.copy_(folded)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonDecodeAttention:
    """Flash-decoding over each row's own length; partial buffers sized once for the cache.

    Each program takes ``split`` positions of one row and KV head. Few, long programs won every
    measurement (attention alone, cold caches, H100, stop 42): a split means partials of the padded
    query group in float32 and a combine kernel, which cost more than the parallelism they buy
    unless the grid would be very small. So a program takes at least ``MIN_SPLIT`` positions, and
    more (doubling) until the grid is near ``TARGET_PROGRAMS``: at contexts of ~700 of 1,408, 512
    to 128 rows run one program per row and KV head (9-22% faster than the 128-512 splits of the
    policy before), 64 rows splits of 512 (0.5B 15.0 vs 18.2 us, 1.5B 24.9 vs 30.6).
    """

    # positions per program at least (a cache this long or shorter: one program per row and head)
    MIN_SPLIT = 512
    # splits grow until the grid has at most this many programs (about three per SM on an H100)
    TARGET_PROGRAMS = 384

    def __init__(
        self, max_rows: int, n_kv: int, group: int, head_dim: int, max_seq: int, device: torch.device
    ):
        if not HAVE_TRITON:
            raise RuntimeError("triton is not importable")
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"head_dim {head_dim} must be a power of two >= 16 for the Triton decode kernel")
        self.block_n = 64
        # Triton launch options (num_warps, num_stages, maxnreg) for every call; None: the policy
        # of ``launch_for`` (the benchmark's A/B sets others)
        self.launch: dict[str, int] | None = None
        self.block_g = max(16, _next_pow2(group))
        self.group, self.d, self.n_kv, self.max_seq = group, head_dim, n_kv, max_seq
        # calls of at least this many rows with a group table, one split, run the grouped kernel
        # (one program per group of rows reading one prompt copy; 0: never)
        self.grouped_min_rows = 0
        self.members = group_members_max(group)
        self.block_m = max(16, _next_pow2(self.members * group))
        self.grouped_launch: dict[str, int] = {}
        # partials of the largest (rows x splits) any call can use, laid out per call
        size = max(b * n_kv * math.ceil(max_seq / self.split_for(b)) for b in range(1, max_rows + 1))
        self._partials(size, device)

    def _partials(self, size: int, device: torch.device) -> None:
        self.m_part = torch.empty(size * self.block_g, dtype=torch.float32, device=device)
        self.l_part = torch.empty(size * self.block_g, dtype=torch.float32, device=device)
        self.o_part = torch.empty(size * self.block_g * self.d, dtype=torch.float32, device=device)

    def launch_for(self, rows: int, n_splits: int) -> dict[str, int]:
        """Triton's defaults (4 warps, 3 stages), except for 64-wide heads read whole by many rows:
        there 2 warps and 2 stages, more programs per SM (attention alone, 512 rows at context
        192, 0.5B heads: 12.5 vs 15.8 us on an H200, 14.2 vs 17.2 on an H100; slower at 64 rows,
        at long contexts and with 128-wide heads, so only there; ``decode_step_gpu.py --attention``)."""
        if self.launch is not None:
            return self.launch
        if self.d <= 64 and rows >= 256 and n_splits == 1:
            return {"num_warps": 2, "num_stages": 2}
        return {}

    def split_for(self, rows: int) -> int:
        """Positions per program: the whole cache up to ``MIN_SPLIT``, else the smallest power of
        two from ``MIN_SPLIT`` that keeps the grid at most ``TARGET_PROGRAMS`` programs (the
        whole cache once that is shorter)."""
        split = self.MIN_SPLIT
        while split < self.max_seq and rows * self.n_kv * -(-self.max_seq // split) > self.TARGET_PROGRAMS:
            split *= 2
        return min(split, self.max_seq)

    def rope_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        pos: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        n_heads: int,
        split: int | None = None,
        share_row: torch.Tensor | None = None,
        share_len: torch.Tensor | None = None,
        groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``rope_attention_ref`` in one kernel (plus the combine): from the projection output
        ``qkv`` [B, (H + 2 Hkv) D] and the ``[S, D]`` RoPE tables to the attention output
        [B, Hkv, G, D]; the new k and v land in the caches at ``pos``.

        ``share_row`` / ``share_len`` [B] (optional, together): row ``b``'s positions below
        ``share_len[b]`` (<= ``pos[b]``) hold the same K/V in row ``share_row[b]``, whose own
        ``pos`` is at least ``share_len[b]`` (no program writes there); they are read from there,
        so the rows of a group that point at one row read its prompt from one copy (the rest come
        from the cache, not memory).

        ``groups``: ``attention_groups``'s table on the device (member rows ``[>= b, members]``
        int32, -1 padded; source row and shared length per group), built from the same
        ``share_row`` / ``share_len``; calls of at least ``grouped_min_rows`` rows in one split
        then run the grouped kernel, which reads each group's prompt once."""
        b, g, d, n_kv = qkv.shape[0], self.group, self.d, self.n_kv
        assert qkv.stride(-1) == 1 and cos.is_contiguous() and signed_sin.is_contiguous()
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and k_cache.shape[2] <= self.max_seq
        assert qkv.shape[1] == (n_heads + 2 * n_kv) * d and n_heads == n_kv * g
        split = split or self.split_for(b)
        n_splits = math.ceil(self.max_seq / split)
        if b * n_kv * n_splits * self.block_g > self.m_part.numel():
            # only an explicit, finer split (the self-check's) gets here; the policy's fits
            self._partials(b * n_kv * n_splits, qkv.device)
        out = torch.empty((b, n_kv, g, d), dtype=qkv.dtype, device=qkv.device)
        share = share_row is not None
        if share != (share_len is not None):
            raise ValueError("pass share_row and share_len together")
        if groups is not None and n_splits == 1 and 0 < self.grouped_min_rows <= b:
            members, src, shared = groups
            assert members.shape[1] == self.members and members.dtype == torch.int32
            _grouped_rope_attn_kernel[(b, n_kv)](
                qkv, cos, signed_sin, pos, members, src, shared, k_cache, v_cache, out,
                qkv.stride(0), cos.stride(0),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                out.stride(0), out.stride(1), out.stride(2),
                b, g, 1.0 / math.sqrt(d),
                N_HEADS=n_heads, MEMBERS=self.members, BLOCK_M=self.block_m, BLOCK_N=self.block_n, D=d,
                IEEE=qkv.dtype == torch.float32, **self.grouped_launch,
            )  # fmt: skip
            return out
        _rope_attn_split_kernel[(b, n_kv, n_splits)](
            qkv, cos, signed_sin, pos, share_row if share else pos, share_len if share else pos,
            k_cache, v_cache, self.o_part, self.m_part, self.l_part, out,
            qkv.stride(0), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            n_splits, g, LOG2E / math.sqrt(d),  # base-2 softmax (the kernel's exp2)
            N_HEADS=n_heads, SPLIT=split, BLOCK_N=self.block_n, BLOCK_G=self.block_g, D=d,
            IEEE=qkv.dtype == torch.float32, DIRECT=n_splits == 1, SHARE=share,
            **self.launch_for(b, n_splits),
        )  # fmt: skip
        return self._combine(out, pos, n_splits, split)

    def _combine(self, out: torch.Tensor, pos: torch.Tensor, n_splits: int, split: int) -> torch.Tensor:
        if n_splits == 1:  # the split kernel wrote ``out`` itself
            return out
        b, n_kv, g, d = out.shape
        _attn_combine_kernel[(b, n_kv)](
            self.o_part, self.m_part, self.l_part, pos, out,
            out.stride(0), out.stride(1), out.stride(2),
            n_splits, g, SPLIT=split, BLOCK_G=self.block_g, D=d,
        )  # fmt: skip
        return out


class TritonSampler:
    """Token and raw log-probability per row: Gumbel-max in one read of the logits, or with
    ``method="cdf"`` inverse CDF (block sums in one read, then one block per row read again; the
    engine's default, ``hf_decode.SAMPLING_DEFAULT``; 8k-entry chunks on 2 warps, always).

    Each row's vocabulary is cut into chunks, one program each, whose partial results a second
    small kernel combines. ``chunk`` (vocabulary entries per program) defaults to ``chunk_for``'s
    policy; a program steps through it ``block`` entries at a time (8 per thread: 512-entry blocks
    on 2 warps sampled 512 rows in 179-180 us against 192-194 us for 1,024 on 4 warps, and 64 rows
    in 34.0 against 34.8 us, on an H100 at stop 33; ``decode_step_gpu.py --sampler-only``). ``screen``
    (default on) computes the noise's two logs only for the vocabulary blocks where some element
    could still beat the best score, found from its hash alone; off, every block that the
    largest-noise bound cannot rule out pays for them (kept for the benchmark's A/B). ``reuse_exp``
    lets rows at temperature 1 screen with the log-sum-exp's own exponentials instead of a second
    one: 1 checks each row's temperature (a branch per block: 10% slower at 512 rows on an H100 at
    stop 36, so the default is 0), 2 takes every row to be at temperature 1 without looking (the
    caller's promise; the benchmark's A/B). ``bitcast_uniform`` (default on) builds the uniform
    from the hash's bits (2% faster there). Every setting gives the same tokens.
    """

    TARGET_PROGRAMS = 2048
    # 16k-entry chunks were 12-14% faster than 8k at 512 rows on the H200 (decode-step bench,
    # stop 24); at 64 rows they would leave the GPU half idle (640 programs)
    CHUNKS = (8192, 16384)

    def __init__(
        self,
        max_rows: int,
        vocab: int,
        device: torch.device,
        screen: bool = True,
        chunk: int | None = None,
        block: int = 512,
        warps: int | None = None,
        reuse_exp: int = 0,
        bitcast_uniform: bool = True,
        method: str = "gumbel",
    ) -> None:
        if not HAVE_TRITON:
            raise RuntimeError("triton is not importable")
        if method not in SAMPLE_REFS:
            raise ValueError(f"method {method!r} must be one of {sorted(SAMPLE_REFS)}")
        self.method = method
        # 8 vocabulary entries per thread unless told (the benchmark's launch A/B)
        self.warps = warps or block // 256
        if block < 256 or block & (block - 1) or min(self.CHUNKS) % block:
            raise ValueError(f"block {block} must be a power of two >= 256 dividing {min(self.CHUNKS)}")
        if chunk is not None and (chunk <= 0 or chunk % block):
            raise ValueError(f"chunk {chunk} must be a positive multiple of the block ({block})")
        self.chunk, self.screen, self.vocab, self.block = chunk, screen, vocab, block
        if reuse_exp not in (0, 1, 2):
            raise ValueError(f"reuse_exp {reuse_exp} must be 0, 1 or 2")
        self.reuse_exp, self.bitcast_uniform = int(reuse_exp), bitcast_uniform
        # partials for the finest split any call can use
        shape = (max_rows, math.ceil(vocab / (chunk or min(self.CHUNKS))))
        self.p_m = torch.empty(shape, dtype=torch.float32, device=device)
        self.p_s = torch.empty(shape, dtype=torch.float32, device=device)
        self.p_best = torch.empty(shape, dtype=torch.float32, device=device)
        self.p_idx = torch.empty(shape, dtype=torch.int32, device=device)
        self.p_raw = torch.empty(shape, dtype=torch.float32, device=device)
        if method == "cdf":  # per CDF_BLOCK: max, log-probability sum, sampling-weight sum
            self.n_blocks = math.ceil(vocab / CDF_BLOCK)
            self.p_cdf = torch.empty((3, max_rows * self.n_blocks), dtype=torch.float32, device=device)

    def chunk_for(self, rows: int) -> int:
        """Vocabulary entries per program: the largest of ``CHUNKS`` that still gives
        ``TARGET_PROGRAMS`` programs (the first program of a chunk always pays for the noise, so
        fewer, longer chunks skip more), else the smallest."""
        if self.chunk is not None:
            return self.chunk
        if self.method == "cdf":  # 8k: 71.5 us at 512 rows against 81.9 (16k), 83.7 (32k) on an H100
            return min(self.CHUNKS)
        for chunk in sorted(self.CHUNKS, reverse=True):
            if rows * math.ceil(self.vocab / chunk) >= self.TARGET_PROGRAMS:
                return chunk
        return min(self.CHUNKS)

    def __call__(
        self, logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, v = logits.shape
        assert logits.stride(-1) == 1 and v == self.vocab
        chunk = self.chunk_for(n)
        n_splits = math.ceil(v / chunk)
        if self.method == "cdf":
            return self._cdf(logits, temperature, seeds, chunk, n_splits)
        # the partials are laid out [row, split] with this call's split count
        p_m, p_s, p_best, p_idx, p_raw = (
            p.view(-1)[: n * n_splits] for p in (self.p_m, self.p_s, self.p_best, self.p_idx, self.p_raw)
        )
        tok = torch.empty(n, dtype=torch.long, device=logits.device)
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        _sample_split_kernel[(n, n_splits)](
            logits, logits.stride(0), temperature, seeds, p_m, p_s, p_best, p_idx, p_raw,
            v, n_splits, CHUNK=chunk, BLOCK=self.block, SCREEN=self.screen, REUSE_EXP=self.reuse_exp,
            BITCAST=self.bitcast_uniform, num_warps=self.warps,
        )  # fmt: skip
        _sample_combine_kernel[(n,)](
            p_m, p_s, p_best, p_idx, p_raw, tok, lp, n_splits, BLOCK_S=max(2, _next_pow2(n_splits)),
        )  # fmt: skip
        return tok, lp

    def _cdf(
        self, logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, chunk: int, n_splits: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, v = logits.shape
        p_m, p_s, p_t = (p[: n * self.n_blocks] for p in self.p_cdf)
        tok = torch.empty(n, dtype=torch.long, device=logits.device)
        lp = torch.empty(n, dtype=torch.float32, device=logits.device)
        _cdf_blocks_kernel[(n, n_splits)](
            logits, logits.stride(0), temperature, p_m, p_s, p_t, v, self.n_blocks, CHUNK=chunk,
            BLOCK=CDF_BLOCK, num_warps=self.warps,
        )  # fmt: skip
        _cdf_pick_kernel[(n,)](
            logits, logits.stride(0), temperature, seeds, p_m, p_s, p_t, tok, lp, v, self.n_blocks,
            BLOCK_NB=_next_pow2(self.n_blocks), BLOCK=CDF_BLOCK, num_warps=4,
        )  # fmt: skip
        return tok, lp


def _cdf_check(
    x: torch.Tensor, temp: torch.Tensor, seeds: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor
) -> str | None:
    """The inverse-CDF kernel's tokens, checked in float64: each sampled token's interval of the
    cumulative distribution holds the row's ``u`` (to 1e-5), each greedy token is a largest logit,
    and the log-probabilities are right. Not token equality with the reference: over a flat
    152k-entry distribution a token's interval is ~7e-6 wide, and float32 sums summed in another
    order (the CPU's, or another reduction tree) move ``u * total`` across a boundary now and then."""
    xd, t = x.double().cpu(), temp.double().cpu()
    tok, lp = tok.cpu(), lp.cpu()
    rows = torch.arange(len(tok))
    greedy = t <= 0
    p = torch.softmax(xd / torch.where(greedy, 1.0, t)[:, None], -1)
    hi = p.cumsum(-1)[rows, tok]
    lo = hi - p[rows, tok]
    u = cdf_uniform(seeds.cpu()).double()
    inside = (lo - 1e-5 <= u) & (u <= hi + 1e-5)
    top = xd[rows, tok] == xd.amax(-1)
    ok = torch.where(greedy, top, inside)
    lp_err = float((lp.double() - torch.log_softmax(xd, -1)[rows, tok]).abs().max())
    if not bool(ok.all()) or lp_err > 1e-3:
        return f"cdf sampling kernel: {int((~ok).sum())} of {len(tok)} tokens off, logprob error {lp_err:.3g}"
    return None


def self_check(kind: str, fn: Any, device: torch.device, **shape: Any) -> str | None:
    """Run a kernel against its reference on random inputs; ``None`` if they agree, else why not.

    Called once when the decoder starts on a GPU, so a kernel that miscompiles on some
    device/driver/Triton version is never used (the reference path is, and the reason is kept).
    """
    g = torch.Generator(device="cpu").manual_seed(1234)
    try:
        if kind == "attention":
            rows, n_kv, group, d, s, dtype = (
                shape[k] for k in ("rows", "n_kv", "group", "d", "seq", "dtype")
            )
            n_heads = n_kv * group
            qkv = torch.randn(rows, (n_heads + 2 * n_kv) * d, generator=g).to(device, dtype)
            ang = torch.arange(s)[:, None] * torch.rand(d // 2, generator=g)[None]
            cos = torch.cat([ang.cos(), ang.cos()], -1).to(device, dtype)
            ssin = torch.cat([-ang.sin(), ang.sin()], -1).to(device, dtype)
            # the last position, the first (the new token alone), both sides of a 64-split boundary
            edges = torch.tensor([s - 1, 0, 64 % s, 63 % s])[:rows]
            pos = torch.cat([edges, torch.randint(0, s, (max(0, rows - 4),), generator=g)]).to(device)
            kc = torch.randn(rows, n_kv, s, d, generator=g).to(device, dtype)
            vc = torch.randn(rows, n_kv, s, d, generator=g).to(device, dtype)
            # shared prompts: rows 1.. hold row 0's K/V below their position (row 0 is furthest
            # along) and read it from there; their own copy of the shared blocks is NaN, so
            # reading it instead shows
            share_row = torch.zeros(rows, dtype=torch.long, device=device)
            share_len = pos.clone()
            share_len[0] = 0
            for r in range(1, rows):
                n = int(pos[r])
                kc[r, :, :n], vc[r, :, :n] = kc[0, :, :n], vc[0, :, :n]
            wk, wv = kc.clone(), vc.clone()
            want = rope_attention_ref(qkv, cos, ssin, pos, wk, wv, n_heads).float()
            tol = 2e-2 if dtype != torch.float32 else 1e-4

            def attempt(hidden: list[int], call: Any) -> str | None:
                """``call(k_cache, v_cache)`` on caches whose first ``hidden[r]`` positions of row
                ``r`` are NaN (what it must read elsewhere); why it disagrees, or None."""
                gk, gv = kc.clone(), vc.clone()
                for r, n in enumerate(hidden):
                    gk[r, :, :n], gv[r, :, :n] = float("nan"), float("nan")
                got = call(gk, gv).float()
                for r, n in enumerate(hidden):
                    gk[r, :, :n], gv[r, :, :n] = wk[r, :, :n], wv[r, :, :n]
                err = float((got - want).norm() / want.norm())
                cache_err = max(float((a.float() - b.float()).abs().max()) for a, b in ((gk, wk), (gv, wv)))
                ok = err < tol and cache_err < 4 * tol
                return None if ok else f"error {err:.3g}, cache error {cache_err:.3g}"

            for split in (None, 64, fn.max_seq):  # this row count's split, the smallest, one split
                for shared in shape.get("share_modes", (False, True)):
                    hidden = [
                        int(pos[r]) // fn.block_n * fn.block_n if shared and r else 0 for r in range(rows)
                    ]
                    extra = {"share_row": share_row, "share_len": share_len} if shared else {}
                    why = attempt(
                        hidden,
                        lambda k, v, split=split, extra=extra: fn.rope_attend(
                            qkv, cos, ssin, pos, k, v, n_heads, split=split, **extra
                        ),
                    )
                    if why:
                        return f"rope attention kernel (split {split}, shared prompts {shared}): {why}"
            if fn.grouped_min_rows and fn.split_for(rows) >= fn.max_seq:  # the grouped kernel
                for sharing in (True, False):  # one group per prompt copy; every row alone
                    # rows past the first block read it from row 0 (which is furthest along)
                    follows = [r > 0 and sharing and int(pos[r]) >= fn.block_n for r in range(rows)]
                    rows_of = [0 if f else r for r, f in enumerate(follows)]
                    lens_of = [fn.block_n if f else 0 for f in follows]
                    table = attention_group_tensors(rows_of, lens_of, rows, fn.members, fn.block_n)
                    hidden = [0] * rows
                    for members_row, shared_len in zip(table[0].tolist(), table[2].tolist(), strict=True):
                        for r in members_row:
                            if r > 0:  # row 0 holds the prompt everyone reads
                                hidden[r] = shared_len
                    groups = tuple(t.to(device) for t in table)
                    saved, fn.grouped_min_rows = fn.grouped_min_rows, 1
                    try:
                        why = attempt(
                            hidden,
                            lambda k, v, groups=groups: fn.rope_attend(
                                qkv, cos, ssin, pos, k, v, n_heads, groups=groups
                            ),
                        )
                    finally:
                        fn.grouped_min_rows = saved
                    if why:
                        return f"grouped rope attention kernel (shared prompts {sharing}): {why}"
            return None
        if kind in ("silu", "scaled_silu"):  # the plain kernel, or scaled by the rows' 1 / rms
            rows, inter, dtype = shape["rows"], shape["inter"], shape["dtype"]
            gu = (torch.randn(rows, 2 * inter, generator=g) * 3).to(device, dtype)
            if kind == "silu":
                want, got = silu_mul_ref(gu.float()), fn(gu)
            else:
                x = (torch.randn(rows, shape["hidden"], generator=g) * 5).to(device, dtype)
                want, got = scaled_silu_mul_ref(gu.float(), x.float(), 1e-6), fn(gu, x, 1e-6)
            err = float((got.float() - want).norm() / want.norm())
            tol = 1e-2 if dtype != torch.float32 else 1e-5
            return None if err < tol else f"{kind.replace('_', ' ')} kernel: relative error {err:.3g}"
        if kind == "sample":
            rows, vocab, dtype = shape["rows"], shape["vocab"], shape["dtype"]
            x = (torch.randn(rows, vocab, generator=g) * 3).to(device, dtype)
            temp = torch.rand(rows, generator=g).to(device) + 0.3
            temp[0] = 0.0
            temp[1:2] = 1.0  # the temperature-1 path (reuse_exp 1)
            if fn.reuse_exp == 2:  # which takes every row to be at temperature 1
                temp[:] = 1.0
            seeds = torch.randint(0, 2**32, (rows,), generator=g).to(device)
            tok, lp = fn(x, temp, seeds)
            if fn.method == "cdf":
                return _cdf_check(x, temp, seeds, tok, lp)
            want_tok, want_lp = SAMPLE_REFS[fn.method](x, temp, seeds)
            same = float((tok == want_tok).float().mean())
            lp_err = float((lp - want_lp).abs().max())
            if same < 0.99 or lp_err > 1e-3:
                return f"sampling kernel: {same:.3f} tokens agree, logprob error {lp_err:.3g}"
            return None
        raise ValueError(kind)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
