"""Log-probability and entropy of each response token from its logits: one read forward, one
read + one write backward.

The reference path (``rlkube.runtime.algos.logprobs_from_logits`` / ``entropy_from_logits``)
casts the ``[tokens, vocab]`` logits to float32 and runs log-sum-exp, gather, softmax, multiply
and sum as separate kernels, each a pass over the vocabulary, and autograd keeps the float32
copy. With Qwen2.5's 151,936-token vocabulary that is most of a 0.5B model's update: the profile
of one update spent 66 ms in ``logsumexp`` alone against 83 ms of matrix multiplies.

The Triton kernels here take the logits in their own dtype and layout (a ``[b, t, V]`` slice of
the model's output is fine), one program per token:

- forward, one pass with an online log-sum-exp: ``lse = log sum exp z``, ``logp = z[y] - lse``,
  ``H = lse - sum softmax(z) z``, with ``z = logits / T`` in float32;
- backward, one pass writing the logits' gradient in their dtype:
  ``dL/dz = g_logp (onehot(y) - p) + g_H p (E[z] - z)``, ``p = exp(z - lse)``, ``E[z] = lse - H``,
  times ``1/T`` for the temperature.

Only ``[tokens]`` float32 results are kept for the backward pass besides the logits autograd
holds anyway. On CPUs, where the kernel's self-check at first use fails, or with
``RLKUBE_FUSED_LOGPROB=0`` in the environment, the reference path runs.
Tested against the reference (values and gradients) in Triton's interpreter,
``tests/trainer/test_token_logprob.py``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor

from rlkube.runtime.algos import entropy_from_logits, logprobs_from_logits

try:  # pragma: no cover - exercised on GPUs and, in interpreter mode, by the kernel tests
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

log = logging.getLogger(__name__)

BLOCK = 4096  # vocabulary entries per loop iteration of one program
NUM_WARPS = 8

if HAVE_TRITON:

    @triton.jit
    def _token_logprob_fwd(
        X,
        sx_b,
        sx_t,
        first,
        t_len,
        TGT,
        LP,
        ENT,
        LSE,
        V,
        inv_t,
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0)
        row = X + (r // t_len).to(tl.int64) * sx_b + (first + r % t_len).to(tl.int64) * sx_t
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)  # sum exp(z - m), lane-wise
        w = tl.zeros([BLOCK], tl.float32)  # sum exp(z - m) z, lane-wise
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            mask = v < V
            z = tl.load(row + v, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, z)
            # a lane that has seen nothing yet keeps m == -inf: exp(0) * 0 keeps its sums at 0
            alpha = tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new))
            e = tl.where(mask, tl.exp(z - m_new), 0.0)
            s = s * alpha + e
            w = w * alpha + e * tl.where(mask, z, 0.0)
            m = m_new
        mm = tl.max(m, 0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - mm))
        total = tl.sum(s * scale, 0)
        lse = mm + tl.log(total)
        y = tl.load(TGT + r)
        zy = tl.load(row + y).to(tl.float32) * inv_t
        tl.store(LP + r, zy - lse)
        tl.store(ENT + r, lse - tl.sum(w * scale, 0) / total)
        tl.store(LSE + r, lse)

    @triton.jit
    def _token_logprob_bwd(
        X,
        sx_b,
        sx_t,
        first,
        t_len,
        TGT,
        LSE,
        ENT,
        G_LP,
        G_ENT,
        GX,
        sg_b,
        sg_t,
        V,
        inv_t,
        HAS_ENT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0)
        bi = (r // t_len).to(tl.int64)
        ti = (first + r % t_len).to(tl.int64)
        row = X + bi * sx_b + ti * sx_t
        grow = GX + bi * sg_b + ti * sg_t
        lse = tl.load(LSE + r)
        g_lp = tl.load(G_LP + r)
        y = tl.load(TGT + r)
        if HAS_ENT:
            g_ent = tl.load(G_ENT + r)
            mean_z = lse - tl.load(ENT + r)
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            mask = v < V
            z = tl.load(row + v, mask=mask, other=0.0).to(tl.float32) * inv_t
            p = tl.exp(z - lse)
            g = tl.where(v == y, g_lp, 0.0) - g_lp * p
            if HAS_ENT:
                g += g_ent * p * (mean_z - z)
            tl.store(grow + v, (g * inv_t).to(GX.dtype.element_ty), mask=mask)


def _as_3d(x: Tensor) -> Tensor:
    """``[..., L, V]`` -> ``[b, L, V]`` without copying when the leading dims allow a view."""
    if x.dim() == 3:
        return x
    if x.dim() == 2:
        return x[None]
    return x.reshape(-1, x.shape[-2], x.shape[-1])


class _FusedTokenLogprob(torch.autograd.Function):
    """``logits`` ``[..., L, V]``: positions ``[first, first + t)`` of each row predict ``targets``
    ``[..., t]``. Taking the whole tensor (not a slice of it) lets the backward pass write the
    gradient of every position at once, where a slice's backward would fill a zero tensor of the
    logits' size and copy the slice's gradient into it."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, inv_t: float, first: int = 0
    ) -> tuple[Tensor, Tensor]:
        x = _as_3d(logits)
        if x.stride(-1) != 1:
            x = x.contiguous()
        b, length, v = x.shape
        t = targets.shape[-1]
        if first < 0 or first + t > length:
            raise ValueError(f"positions [{first}, {first + t}) outside the logits' {length}")
        n = b * t
        tgt = targets.reshape(n).to(torch.int64).contiguous()
        logp = torch.empty(n, dtype=torch.float32, device=x.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        if n:
            _token_logprob_fwd[(n,)](
                x, x.stride(0), x.stride(1), first, t, tgt, logp, ent, lse, v, inv_t,
                BLOCK=BLOCK, num_warps=NUM_WARPS,
            )  # fmt: skip
        ctx.save_for_backward(x, tgt, lse, ent)
        ctx.inv_t, ctx.first, ctx.t = inv_t, first, t
        ctx.shape = logits.shape
        ctx.set_materialize_grads(False)
        return logp.reshape(targets.shape), ent.reshape(targets.shape)

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Any, ...]:
        x, tgt, lse, ent = ctx.saved_tensors
        b, length, v = x.shape
        first, t = ctx.first, ctx.t
        n = b * t
        grad = torch.empty((b, length, v), dtype=x.dtype, device=x.device)
        grad[:, :first].zero_()  # positions that predict no target
        grad[:, first + t :].zero_()
        g_lp = torch.zeros(n, dtype=torch.float32, device=x.device) if g_logp is None else g_logp
        g_lp = g_lp.reshape(n).float().contiguous()
        has_ent = g_ent is not None
        g_h = g_ent.reshape(n).float().contiguous() if g_ent is not None else g_lp
        if n:
            _token_logprob_bwd[(n,)](
                x, x.stride(0), x.stride(1), first, t, tgt, lse, ent, g_lp, g_h,
                grad, grad.stride(0), grad.stride(1), v, ctx.inv_t,
                HAS_ENT=has_ent, BLOCK=BLOCK, num_warps=NUM_WARPS,
            )  # fmt: skip
        return grad.reshape(ctx.shape), None, None, None


def token_logprobs_reference(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """The float32 PyTorch path: ``log softmax(logits / T)[targets]`` and the entropy, ``[...]``
    each; the entropy carries a gradient only with ``entropy_grad`` (otherwise it is a metric)."""
    z = logits / temperature if temperature != 1.0 else logits
    logp = logprobs_from_logits(z, targets)
    if entropy_grad:
        return logp, entropy_from_logits(z)
    with torch.no_grad():
        return logp, entropy_from_logits(z.detach())


_CHECKED: dict[tuple[str, int | None], str | None] = {}


def fused_kernel_problem(device: torch.device) -> str | None:
    """Why the fused kernel is not used on ``device`` (``None``: it is). Checked once per device:
    the kernel runs against the reference on random bf16 logits, values and gradients."""
    if device.type != "cuda":
        return "not a GPU (the PyTorch path runs)"
    if os.environ.get("RLKUBE_FUSED_LOGPROB", "1") == "0":
        return "switched off by RLKUBE_FUSED_LOGPROB=0"
    if not HAVE_TRITON:
        return "triton is not importable"
    key = (device.type, device.index)
    if key not in _CHECKED:
        _CHECKED[key] = problem = self_check(device)
        if problem is not None:
            log.warning(
                "fused log-prob kernels off on %s (%s): the float32 PyTorch path runs", device, problem
            )
    return _CHECKED[key]


def self_check(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """``None`` when the fused kernel agrees with the reference on ``device``, else why not.

    Runs with gradients on and autocast off whatever the caller's context: the first use is often a
    ``no_grad`` pass (old or reference log-probs)."""
    g = torch.Generator(device="cpu").manual_seed(4321)
    with torch.enable_grad(), torch.autocast(device_type=device.type, enabled=False):
        return _compare_with_reference(device, dtype, g)


def _compare_with_reference(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> str | None:
    try:
        b, t, v = 3, 5, 5000  # vocabulary not a multiple of BLOCK: the last block is partial
        full = (torch.randn(b, t + 1, v, generator=g) * 4).to(device, dtype)
        targets = torch.randint(0, v, (b, t), generator=g).to(device)
        c_lp, c_ent = (torch.randn(b, t, generator=g).to(device) for _ in range(2))
        got: list[Tensor] = []  # detached values and gradients, fused first
        for fused in (True, False):
            leaf = full.detach().clone().requires_grad_()
            if fused:  # the model's whole output, positions [0, t) predicting the targets
                lp, ent = _FusedTokenLogprob.apply(leaf, targets, 1 / 0.7, 0)
            else:
                lp, ent = token_logprobs_reference(leaf[:, :t].float(), targets, 0.7, entropy_grad=True)
            ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
            assert leaf.grad is not None
            got += [lp.detach().float(), ent.detach().float(), leaf.grad.float()]
        for name, a, ref in zip(("logp", "entropy", "gradient"), got[:3], got[3:], strict=True):
            err = float((a - ref).abs().max())
            tol = 1e-3 * max(1.0, float(ref.abs().max()))
            if not err <= tol:
                return f"fused log-prob kernel: {name} differs from the reference by {err:.3g} (> {tol:.3g})"
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    entropy_grad: bool = False,
    first: int = 0,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target token and the entropy at each position under ``softmax(logits / T)``.

    ``logits`` ``[..., L, V]`` in any float dtype (strided is fine), ``targets`` ``[..., t]``:
    positions ``[first, first + t)`` of the logits predict the targets (pass the model's whole
    output rather than a slice of it: the gradient is then written once, not zero-filled and
    copied). Both results float32 ``[..., t]``. ``entropy_grad``: the entropy is part of the loss
    (its gradient flows); otherwise it is only a metric. Fused Triton kernels on GPUs that passed
    the self-check, the float32 PyTorch path elsewhere.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    t = targets.shape[-1] if targets.dim() else 0
    if logits.shape[:-2] != targets.shape[:-1] or not 0 <= first <= logits.shape[-2] - t:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} from position {first} disagree"
        )
    if fused_kernel_problem(logits.device) is None:
        logp, ent = _FusedTokenLogprob.apply(logits, targets, 1.0 / temperature, first)
        return logp, (ent if entropy_grad else ent.detach())
    window = logits[..., first : first + t, :] if (first, t) != (0, logits.shape[-2]) else logits
    return token_logprobs_reference(window, targets, temperature, entropy_grad)
