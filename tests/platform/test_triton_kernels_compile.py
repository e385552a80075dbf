"""Every Triton kernel of the runtime compiles for the GPUs rlkube targets, on this CPU machine.

Triton compiles ahead of time for a named target without a device: NVIDIA through its bundled
``ptxas`` to a cubin, AMD through its bundled LLVM to an ``hsaco`` code object. The interpreter
tests (``tests/rollout/test_hf_decode.py``, ``tests/trainer/test_token_logprob.py``) check what the
kernels compute; this checks that the compiler accepts them for Hopper and Ampere and for the AMD
Instinct MI300X/MI325X (gfx942), MI355X (gfx950) and MI250X (gfx90a), with the argument types and
constexprs the launchers pass for Qwen2.5's shapes. Running them on AMD hardware is not possible
here (no AMD GPU); the kernels' start-up self-checks guard that on a real device.
"""

from __future__ import annotations

from typing import Any

import pytest

triton = pytest.importorskip("triton", reason="triton ships with torch in this environment")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rlkube.runtime.rollout import decode_linear  # noqa: E402
from rlkube.runtime.rollout import kernels as decode  # noqa: E402
from rlkube.runtime.trainer import token_logprob  # noqa: E402

TARGETS = {
    "sm90 (H100/H200)": GPUTarget("cuda", 90, 32),
    "sm80 (A100)": GPUTarget("cuda", 80, 32),
    "gfx942 (MI300X/MI325X)": GPUTarget("hip", "gfx942", 64),
    "gfx950 (MI355X)": GPUTarget("hip", "gfx950", 64),
    "gfx90a (MI250X)": GPUTarget("hip", "gfx90a", 64),
}

F32 = "fp32"


def _variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """(name, kernel, pointer/float argument types, constexprs) as the launchers pass them."""
    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    attn_ptrs = {
        **dict.fromkeys(("QKV", "COS", "SIN", "K", "V", "OUT"), "*bf16"),
        **dict.fromkeys(("O_PART", "M_PART", "L_PART"), "*fp32"),
        **dict.fromkeys(("POS", "SHARE_ROW", "SHARE_LEN"), "*i64"),
        "scale": F32,
    }
    # Qwen2.5-0.5B: 14 query heads on 2 KV heads of 64; 1.5B: 12 on 2 of 128
    for n_heads, d in ((14, 64), (12, 128)):
        for direct, share in ((False, False), (False, True), (True, True)):
            consts = dict(
                N_HEADS=n_heads, SPLIT=64, BLOCK_N=64, BLOCK_G=16, D=d, IEEE=False, DIRECT=direct, SHARE=share
            )
            name = f"rope attention D={d} direct={direct} share={share}"
            out.append((name, decode._rope_attn_split_kernel, attn_ptrs, consts))
        # the launch policy's other setting (TritonDecodeAttention.launch_for: 64-wide heads, many rows)
        consts = dict(
            N_HEADS=n_heads, SPLIT=512, BLOCK_N=64, BLOCK_G=16, D=d, IEEE=False, DIRECT=True, SHARE=True
        )
        name = f"rope attention D={d} direct, 2 warps 2 stages"
        out.append(
            (name, decode._rope_attn_split_kernel, attn_ptrs, {**consts, "num_warps": 2, "num_stages": 2})
        )
        # the grouped kernel (hf_decode's grouped_attention_min_rows): 8 rows' query heads in one tile
        grouped_ptrs = {
            **dict.fromkeys(("QKV", "COS", "SIN", "K", "V", "OUT"), "*bf16"),
            **dict.fromkeys(("GROUPS", "GROUP_SHARED"), "*i32"),
            **dict.fromkeys(("POS", "GROUP_SRC"), "*i64"),
            "scale": F32,
        }
        for warps, stages in ((4, 3), (8, 2)):
            consts = dict(N_HEADS=n_heads, MEMBERS=8, BLOCK_M=64, BLOCK_N=64, D=d, IEEE=False)
            name = f"grouped rope attention D={d} {warps} warps {stages} stages"
            out.append(
                (name, decode._grouped_rope_attn_kernel, grouped_ptrs,
                 {**consts, "num_warps": warps, "num_stages": stages})
            )  # fmt: skip
        combine_ptrs = {
            **dict.fromkeys(("O_PART", "M_PART", "L_PART"), "*fp32"),
            "POS": "*i64",
            "OUT": "*bf16",
        }
        out.append(
            (
                f"attention combine D={d}",
                decode._attn_combine_kernel,
                combine_ptrs,
                dict(SPLIT=64, BLOCK_G=16, D=d),
            )
        )
    sample_ptrs = {
        "X": "*bf16", "TEMP": "*fp32", "SEEDS": "*i64",
        **dict.fromkeys(("P_M", "P_S", "P_BEST", "P_RAW"), "*fp32"), "P_IDX": "*i32",
    }  # fmt: skip
    # the engine's settings (screen on and off), then the benchmark's A/B of the screen's maths
    for screen, reuse, bitcast in (
        (False, 0, True),
        (True, 0, True),
        (True, 1, True),
        (True, 2, True),
        (True, 0, False),
    ):
        consts = dict(CHUNK=8192, BLOCK=512, SCREEN=screen, REUSE_EXP=reuse, BITCAST=bitcast, num_warps=2)
        name = f"sampling split screen={screen} reuse_exp={reuse} bitcast={bitcast}"
        out.append((name, decode._sample_split_kernel, sample_ptrs, consts))
    pick_ptrs = {
        **dict.fromkeys(("P_M", "P_S", "P_BEST", "P_RAW", "LP"), "*fp32"), "P_IDX": "*i32", "TOK": "*i64",
    }  # fmt: skip
    out.append(("sampling combine", decode._sample_combine_kernel, pick_ptrs, dict(BLOCK_S=32)))
    # inverse-CDF sampling: the block sums (2 warps, as the engine's policy launches them), the pick
    cdf_ptrs = {
        "X": "*bf16", "TEMP": "*fp32", "SEEDS": "*i64", "TOK": "*i64",
        **dict.fromkeys(("P_M", "P_S", "P_T", "LP"), "*fp32"),
    }  # fmt: skip
    consts = dict(CHUNK=16384, BLOCK=decode.CDF_BLOCK, num_warps=2)
    out.append(("cdf sampling blocks", decode._cdf_blocks_kernel, cdf_ptrs, consts))
    consts = dict(BLOCK_NB=512, BLOCK=decode.CDF_BLOCK)
    out.append(("cdf sampling pick", decode._cdf_pick_kernel, cdf_ptrs, consts))
    # the MLP's SiLU: plain, and scaled by each row's 1 / rms (hf_decode's fold_mlp_norm, 1.5B's width)
    silu_ptrs = {**dict.fromkeys(("GU", "X", "OUT"), "*bf16"), "eps": F32}
    for scaled, block_h in ((False, 1), (True, 2048)):
        consts = dict(BLOCK=1024, BLOCK_H=block_h, SCALED=scaled)
        out.append((f"silu mul scaled={scaled}", decode._silu_mul_kernel, silu_ptrs, consts))
    lin_ptrs = {
        **dict.fromkeys(("X", "W", "NORM_W", "BIAS", "OUT"), "*bf16"),
        **dict.fromkeys(("WS", "WS_SQ"), "*fp32"), "COUNT": "*i32", "eps": F32,
    }  # fmt: skip
    # the small-batch linear layers as the decoder launches them (TritonSmallLinear.plan): q/k/v
    # (norm, bias, split-K), o and down (residual, split-K), gate/up (norm, SiLU gate, one split);
    # NVIDIA's 128-wide K blocks in 3 stages, AMD's 64-wide in 2
    for name, norm, gated, residual, bias, split, bn in (
        ("q/k/v", True, False, False, True, 3, 64),
        ("o", False, False, True, False, 4, 64),
        ("gate/up", True, True, False, False, 1, 32),
        ("down", False, False, True, False, 9, 64),
    ):
        for bk, stages in ((128, 3), (64, 2)):
            consts = dict(
                NORM=norm, GATED=gated, RESIDUAL=residual, HAS_BIAS=bias, IEEE=False, SPLIT=split,
                K_PER_SPLIT=2 * bk, BM=64, BN=bn, BK=bk, num_warps=4, num_stages=stages,
            )  # fmt: skip
            out.append((f"small linear {name} BK={bk}", decode_linear._small_linear_kernel, lin_ptrs, consts))
    # the large-batch tile (blocks of 128 rows, 8 warps), gated: the largest accumulators
    consts = dict(
        NORM=True, GATED=True, RESIDUAL=False, HAS_BIAS=False, IEEE=False, SPLIT=2, K_PER_SPLIT=128,
        BM=128, BN=128, BK=64, num_warps=8, num_stages=3,
    )  # fmt: skip
    out.append(("small linear gate/up 128x128", decode_linear._small_linear_kernel, lin_ptrs, consts))
    lp_ptrs = {
        "X": "*bf16", "GX": "*bf16", "TGT": "*i64", "inv_t": F32,
        **dict.fromkeys(("LP", "ENT", "LSE", "G_LP", "G_ENT"), "*fp32"),
    }  # fmt: skip
    out.append(
        ("token logprob fwd", token_logprob._token_logprob_fwd, lp_ptrs, dict(BLOCK=token_logprob.BLOCK))
    )
    for has_ent in (False, True):
        consts = dict(HAS_ENT=has_ent, BLOCK=token_logprob.BLOCK)
        out.append((f"token logprob bwd ent={has_ent}", token_logprob._token_logprob_bwd, lp_ptrs, consts))
    return out


def _compile(kernel: Any, types: dict[str, str], consts: dict[str, Any], target: Any) -> Any:
    consts = dict(consts)  # launch options ride along with the constexprs in _variants
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages") if k in consts}
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in kernel.arg_names}
    # as a launch specialises them: tensors from PyTorch's allocator are 16-byte aligned (vectorised,
    # pipelined loads); the integers stay general
    aligned = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if signature[n][0] == "*"
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=aligned)
    return triton.compile(source, target=target, options=options or None)


@pytest.mark.parametrize("target", list(TARGETS), ids=list(TARGETS))
def test_every_triton_kernel_compiles_for_the_target_gpu(target: str) -> None:
    assert decode.HAVE_TRITON and token_logprob.HAVE_TRITON
    binary = "cubin" if TARGETS[target].backend == "cuda" else "hsaco"
    failed = {}
    for name, kernel, types, consts in _variants():
        try:
            compiled = _compile(kernel, types, consts, TARGETS[target])
            assert compiled.asm.get(binary), f"no {binary}"
        except Exception as exc:  # report every kernel that fails, not only the first
            failed[name] = f"{type(exc).__name__}: {str(exc)[:500]}"
    assert not failed, failed
