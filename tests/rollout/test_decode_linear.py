"""The small-batch linear kernel (``rollout.decode_linear``) against its PyTorch reference.

GPU code run in Triton's interpreter (``TRITON_INTERPRET=1``, a subprocess; float32, which the
interpreter computes exactly enough to compare at 1e-5). Every layer kind of a decode step, row
counts from one to the largest bucket, and K cut into one, several and uneven splits: the split
path's partial sums, the last program's reduction and its counter reset (a second call, as a graph
replay makes, must give the same result) are what a GPU run would otherwise be the first to test.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlkube.runtime.rollout import decode_linear

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from rlkube.runtime.rollout import decode_linear as L
    fn = L.TritonSmallLinear(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    errs, splits, row_blocks, repeat_same = {}, {}, {}, True
    # (outputs, K, kind): q/k/v with norm and bias, o and down into the residual, gate/up gated;
    # K=100 leaves a ragged last block and, split, a ragged last split
    for n, k, kind in ((72, 40, "qkv"), (40, 40, "o"), (50, 40, "gate"), (40, 100, "down")):
        for m in (1, 5, 16, 64, 100):
            for programs in (1, 8, 64):
                # past 64 rows, blocks of 32 rows: four row blocks, the last one ragged
                fn.launch = {"programs": programs, "bn": 16, "bk": 16, **({"bm": 32} if m > 64 else {})}
                gated = kind == "gate"
                x = torch.randn(m, k, generator=g)
                w = torch.randn(2 * n if gated else n, k, generator=g) * 0.1
                kw = {}
                if kind in ("qkv", "gate"):
                    kw["norm"] = torch.rand(k, generator=g) + 0.5
                if kind == "qkv":
                    kw["bias"] = torch.randn(n, generator=g)
                fn.reserve(m, n, k, gated)
                res = torch.randn(m, n, generator=g)
                for call in range(2):
                    if kind in ("o", "down"):
                        kw["out"] = res.clone()
                    ref_kw = {a: (b.clone() if a == "out" else b) for a, b in kw.items()}
                    want = L.small_linear_ref(x, w, gated=gated, eps=1e-6, **ref_kw)
                    got = fn(x, w, gated=gated, eps=1e-6, **kw)
                    if call == 0:
                        first = got.clone()
                    else:
                        repeat_same &= bool(torch.equal(first, got))
                key = f"{kind} rows={m} programs={programs}"
                errs[key] = float((got - want).abs().max() / want.abs().max())
                plan = fn.plan(m, n, k, gated)
                splits[key] = plan.split
                row_blocks[key] = plan.m_tiles
    # a call the workspace was not reserved for raises instead of growing it under a graph
    fn.launch = {"programs": 64, "bn": 16, "bk": 16}
    # reserving a shape that fits moves nothing (captured graphs stay valid); a bigger one does
    same = fn.reserve(64, 40, 100, False)
    grown = fn.reserve(64, 40, 4000, False)
    try:
        fn(torch.randn(64, 4000), torch.randn(640, 4000), out=torch.zeros(64, 640))
        unreserved = None
    except RuntimeError as exc:
        unreserved = str(exc)
    print(json.dumps({"errs": errs, "splits": splits, "row_blocks": row_blocks, "repeat_same": repeat_same,
                      "counters": int(fn.count.abs().sum()), "unreserved": unreserved,
                      "reserve_moved": [same, grown]}))
    """
)


def test_every_layer_kind_and_split_matches_the_reference_in_the_interpreter(
    triton_interpret: Callable[[str], dict[str, Any]],
) -> None:
    out = triton_interpret(SCRIPT)
    worst = max(out["errs"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst
    # the cases really cover one split, several, and a K cut unevenly (down: 7 blocks of 16)
    assert {1, 3, 7} <= set(out["splits"].values()), out["splits"]
    assert set(out["row_blocks"].values()) == {1, 4}  # one row block, and four (100 rows in 32s)
    assert out["repeat_same"], "a second launch (a graph replay) must give bitwise the same output"
    assert out["counters"] == 0, "the last program of each tile resets its counter"
    assert out["unreserved"] and "not reserved" in out["unreserved"]
    assert out["reserve_moved"] == [False, True]


def test_plan_fills_the_gpu() -> None:
    """The split targets about one program per SM; past 64 rows, blocks of 128 rows."""
    lin = decode_linear.TritonSmallLinear.__new__(decode_linear.TritonSmallLinear)
    lin.n_sm, lin.hip, lin.launch = 132, False, {}
    down = lin.plan(64, 896, 4864, gated=False)  # Qwen2.5-0.5B's down projection: 14 tiles of 64
    assert (down.n_tiles, down.split, down.k_per_split) == (14, 8, 640)  # 38 K blocks, 5 per split
    assert down.programs <= 132 and down.split * down.k_per_split >= 4864
    gate = lin.plan(8, 4864, 896, gated=True)  # its gate/up: 152 tiles of 32 outputs, one split
    assert (gate.bm, gate.n_tiles, gate.split) == (16, 152, 1)
    big = lin.plan(512, 1536, 8960, gated=False)  # Qwen2.5-1.5B's down projection at 512 rows
    assert (big.bm, big.m_tiles, big.n_tiles, big.split) == (128, 4, 24, 1)
    with pytest.raises(ValueError, match="no rows"):
        lin.plan(0, 896, 896, gated=False)


def test_reference_is_the_decoders_unfused_layer() -> None:
    """``small_linear_ref`` is the decode step's q/k/v, gate/up + SiLU and residual GEMMs."""
    from rlkube.runtime.rollout import hf_decode

    g = torch.Generator().manual_seed(1)
    x, norm, w, b = (torch.randn(*s, generator=g) for s in ((3, 8), (8,), (12, 8), (12,)))
    qkv = hf_decode.layer_qkv(x, (norm, w, b), 1e-6)
    assert torch.allclose(decode_linear.small_linear_ref(x, w, norm=norm, eps=1e-6, bias=b), qkv)
    mlp = hf_decode.layer_mlp_in(x, norm, w, 1e-6)
    assert torch.allclose(decode_linear.small_linear_ref(x, w, norm=norm, eps=1e-6, gated=True), mlp)
    res = torch.randn(3, 12, generator=g)
    want = hf_decode.residual_linear_(res.clone(), x, w, None)
    assert torch.allclose(decode_linear.small_linear_ref(x, w, out=res.clone()), want)


def test_decoder_refuses_a_negative_row_limit_for_the_kernel() -> None:
    from transformers import AutoModelForCausalLM

    from rlkube.runtime.models.tiny import tiny_qwen2_config
    from rlkube.runtime.rollout.hf_decode import StaticDecoder

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(40, hidden_size=64, num_heads=2)).eval()
    with pytest.raises(ValueError, match="linear_max_rows must be an integer >= 0"):
        StaticDecoder(model, num_slots=4, max_seq_len=16, max_new_tokens=4, linear_max_rows=-1)
    off = StaticDecoder(model, num_slots=4, max_seq_len=16, max_new_tokens=4, kernels_setting=False)
    assert off.kernels_used["linear"] == "torch" and off.linear_max_rows == 0
