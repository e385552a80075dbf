"""The fused token log-prob/entropy kernels equal the float32 PyTorch path, values and gradients.

The kernels are GPU code; here they run in Triton's interpreter (``TRITON_INTERPRET=1``, in a
subprocess, since the flag is read when a kernel is defined) on float32 and float16 logits (the
interpreter cannot run bf16; on a GPU the trainer repeats the check in bf16 at first use and falls
back to PyTorch if the kernel disagrees). The logits arrive as a strided slice of a longer output,
as the model returns them, or whole with the window of positions that predict the targets
starting at 1; the vocabulary is not a multiple of the kernel's block.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlkube.runtime.algos import entropy_from_logits, logprobs_from_logits
from rlkube.runtime.trainer import token_logprob

SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    from rlkube.runtime.trainer import token_logprob as tk

    out = {}
    g = torch.Generator().manual_seed(0)
    b, t, v = 2, 3, tk.BLOCK + 905   # two blocks, the second partial
    for dtype in (torch.float32, torch.float16):
        for temp in (1.0, 0.7):
            for with_ent in (False, True):
                full = (torch.randn(b, t + 1, v, generator=g) * 6).to(dtype)
                full[0, 0, 7] = 60.0            # one dominant logit: the online max must hold
                targets = torch.randint(0, v, (b, t), generator=g)
                targets[1, 2] = v - 1           # the last entry of the partial block
                c_lp, c_ent = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
                # the model's whole output with the window at position `first`, or a slice of it
                first, whole = (1, True) if with_ent else (0, False)
                res = []
                for fused in (True, False):
                    leaf = full.clone().requires_grad_()
                    x = leaf[:, first : first + t]
                    if fused:
                        lp, ent = tk._FusedTokenLogprob.apply(
                            leaf if whole else x, targets, 1.0 / temp, first if whole else 0
                        )
                        if not with_ent:
                            ent = ent.detach()
                    else:
                        lp, ent = tk.token_logprobs_reference(x.float(), targets, temp, with_ent)
                    loss = (lp * c_lp).sum() + ((ent * c_ent).sum() if with_ent else 0.0)
                    loss.backward()
                    res.append((lp.detach(), ent.detach(), leaf.grad.float()))
                (a_lp, a_ent, a_g), (r_lp, r_ent, r_g) = res
                key = f"{str(dtype)[6:]}-T{temp}-ent{int(with_ent)}"
                out[key] = {
                    "lp": float((a_lp - r_lp).abs().max()),
                    "ent": float((a_ent - r_ent).abs().max()),
                    "grad": float((a_g - r_g).abs().max()),
                    "grad_scale": float(r_g.abs().max()),
                    "outside_window_grad_zero": bool((a_g[:, 0 if first else t] == 0).all()),
                }
    out["self_check"] = tk.self_check(torch.device("cpu"), torch.float32)
    with torch.no_grad():  # the trainer's first call is often a no-grad pass
        out["self_check_no_grad"] = tk.self_check(torch.device("cpu"), torch.float32)
    print(json.dumps(out))
    """
)


def test_fused_kernels_match_the_float32_path_in_the_interpreter(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    assert token_logprob.HAVE_TRITON, "triton is part of the test environment (torch's dependency)"
    out = triton_interpret(SCRIPT)
    assert out.pop("self_check") is None
    assert out.pop("self_check_no_grad") is None
    assert len(out) == 8
    for key, err in out.items():
        # float16 logits: the gradient is rounded to float16 on the way back in both paths
        tol = 1e-5 if key.startswith("float32") else 2e-3
        assert err["lp"] < 1e-4 and err["ent"] < 1e-4, (key, err)
        assert err["grad"] <= tol * max(1.0, err["grad_scale"]), (key, err)
        assert err["outside_window_grad_zero"], key  # the position outside the window gets none


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_cpu_path_is_the_reference_maths_at_the_sampling_temperature(entropy_grad: bool) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 30, generator=g, requires_grad=True)
    targets = torch.randint(0, 30, (2, 4), generator=g)
    assert token_logprob.fused_kernel_problem(logits.device) == "not a GPU (the PyTorch path runs)"
    lp, ent = token_logprob.token_logprobs(logits, targets, 0.5, entropy_grad=entropy_grad)
    assert torch.allclose(lp, logprobs_from_logits(logits / 0.5, targets))
    assert torch.allclose(ent, entropy_from_logits(logits / 0.5))
    assert ent.requires_grad is entropy_grad


def test_bad_temperature_and_shapes_are_refused_with_the_field() -> None:
    x = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprob.token_logprobs(x, torch.zeros(2, 3, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="disagree"):
        token_logprob.token_logprobs(x, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="from position 1 disagree"):
        token_logprob.token_logprobs(x, torch.zeros(2, 3, dtype=torch.long), first=1)


def test_cpu_path_reads_the_window_of_the_whole_output() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 30, generator=g)
    targets = torch.randint(0, 30, (2, 4), generator=g)
    lp, ent = token_logprob.token_logprobs(logits, targets, first=1)
    assert torch.equal(lp, logprobs_from_logits(logits[:, 1:5], targets))
    assert torch.equal(ent, entropy_from_logits(logits[:, 1:5]))
