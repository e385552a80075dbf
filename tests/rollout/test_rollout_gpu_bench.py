"""The GPU benchmarks run end to end in --smoke mode (tiny shapes on the CPU) and report honest bounds.

They also run the way the GPU machine runs them: plain ``python3`` with no rlkube install and no
pydantic (``rlkube.api`` needs it; a benchmark must not import it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Makes this interpreter look like the GPU machine's: pydantic, Ray and vLLM missing, rlkube not installed.
GPU_MACHINE_SITE = """
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "ray", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r} (as on the GPU machine)")
        return None
sys.meta_path.insert(0, _Missing())
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
"""


def run_bench(
    name: str, tmp_path: Path, *args: str, gpu_machine: bool = False, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHONSAFEPATH": "1",
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        **(env_extra or {}),
    }
    if gpu_machine:
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(GPU_MACHINE_SITE)
        env["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu" / name), "--smoke", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_rollout_gpu_bench_smoke_without_rlkube_install_or_pydantic(tmp_path: Path) -> None:
    proc = run_bench("rollout_gpu.py", tmp_path, gpu_machine=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "rollout-gpu.json").read_text())
    assert report["read_bandwidth_gbs"] > 0 and report["gemm_tflops"] > 0
    (res,) = report["results"]
    for shape, batch in (("b64", 4), ("b512", 6), ("rl", 6)):
        r = res[shape]
        assert r["batch"] == batch and r["tokens"] == r["bound"]["tokens"]
        assert r["logprob_max_abs_err_vs_teacher_forced"] < 1e-4  # fp32 on the CPU
        # reading each prompt once reads strictly less; the times tie when the CPU's measured GEMM
        # rate (low under load) makes every step compute-bound, so the fractions compare with <=
        assert r["unique_read_bound"]["memory_seconds"] < r["bound"]["memory_seconds"]
        assert 0 < r["fraction_of_unique_read_bound"] <= r["fraction_of_bound"] < 1  # a lower bound time
        assert r["share_prompt_reads"] is True
        cpu_path = {"attention": "sdpa", **dict.fromkeys(("sampling", "silu", "linear", "gated"), "torch")}
        assert r["kernels"] == cpu_path
        # every token came over behind its chunk, none was left for the collection
        assert r["harvest_tokens"] and r["tokens_by_route"] == {"harvest": r["tokens"], "collect": 0}
    rl = res["rl"]
    assert rl["response_len"]["min"] < rl["response_len"]["max"]  # drawn lengths
    assert rl["prefill_forwards"] == 1  # 3 prompts x 2 samples: one batched prefill
    assert sum(rl["steps_by_bucket"].values()) < rl["response_len"]["max"]  # no idle steps at the end
    assert res["generate_b64"]["tokens"] == res["b64"]["tokens"]


def test_decode_step_bench_times_each_attention_split_and_sampler_setting_with_the_triton_kernels(
    tmp_path: Path,
) -> None:
    """The A/B of the captured decode step runs its Triton kernels (here in the interpreter) per
    split, and the sampling kernel per setting, each giving the same tokens."""
    configs = (
        *("default", "direct", "split128", "split256", "shared64", "block32", "silu-inductor", "down-k2"),
        "gated",
    )
    proc = run_bench(
        "decode_step_gpu.py", tmp_path, "--configs", ",".join(configs), gpu_machine=True,
        env_extra={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "decode-step-gpu.json").read_text())
    by_config = {r["config"]: r for r in report["results"]}
    assert set(by_config) == set(configs)
    # a 128-position cache is short enough for one program per row and KV head by default
    assert [by_config[c]["split"] for c in configs] == [128, 128, 128, 256, 128, 128, 128, 128, 128]
    # the gated GEMM (SiLU in its epilogue) runs in its config only
    assert [c for c in configs if by_config[c]["gated"] == "triton"] == ["gated"]
    assert all(0 < r["fraction_of_bound"] < 1 and r["step_ms"] > 0 for r in report["results"])
    variants = [
        *("default", "no-screen", "reuse-exp", "reuse-exp-all", "int-to-float"),
        *("chunk4k", "chunk8k", "chunk16k", "chunk32k", "block1k", "block2k", "block1k-warps2"),
        *("cdf", "cdf-chunk16k", "cdf-chunk32k"),
    ]
    assert [(r["sampler"], r["variant"]) for r in report["sampler"]] == [
        (shape, v) for shape in ("normal", "zipf1", "zipf2") for v in variants
    ]
    assert all(r["same_tokens_as_first_variant"] for r in report["sampler"])
    chunks = [r["chunk"] for r in report["sampler"][: len(variants)]]
    assert chunks == [8192] * 5 + [4096, 8192, 16384, 32768] + [8192] * 3 + [8192, 16384, 32768]
    assert [r["method"] for r in report["sampler"][: len(variants)]] == ["gumbel"] * 12 + ["cdf"] * 3
    assert report["capture_failure"] == {"ran": False, "why": "needs a CUDA or ROCm device"}
    assert all(r["us"] > 0 and 0 < r["fraction_of_read_bound"] < 1 for r in report["sampler"])


def test_trainer_gpu_bench_smoke_without_rlkube_install_or_pydantic(tmp_path: Path) -> None:
    """``python bench/gpu/trainer_gpu.py`` as its docstring says, on a machine without pydantic."""
    proc = run_bench("trainer_gpu.py", tmp_path, "--compile", "off", gpu_machine=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "trainer-gpu.json").read_text())
    assert data["gemm_tflops"] > 0 and data["read_bandwidth_gbs"] > 0
    entry = data["results"][0]
    today, rl = entry["today"], entry["rl"]
    assert len(today["steps"]) == 3 and entry["mfu_update"] == today["mfu_update"] > 0
    # after the warm-up, the rank-group update path (the trainer's) and the direct one alternate
    assert [s["update_path"] for s in today["steps"]] == ["direct", "group", "direct"]
    assert set(today["update_paths"]) == {"update_group_s", "update_direct_s", "group_over_direct"}
    assert [s["update_path"] for s in rl["steps"]] == ["direct", "group"]
    assert all(s["completion_tokens"] == 2 * 2 * 8 for s in today["steps"])  # no stop ids: full length
    # one epoch x one mini-batch: the update's own detached log-probs are pi_old, no extra pass
    assert today["old_logprob_pass"] is False and all(s["old_logprob_s"] == 0.0 for s in today["steps"])
    assert today["engine_compiled"] is False  # --compile off
    assert rl["batch"] == 3 * 2 and 0 < rl["rollout_fraction_of_bound"] < 1
    assert all(0 <= s["padding_fraction"] < 1 for s in rl["steps"])


def test_trainer_gpu_bench_halves_its_passes_after_running_out_of_gpu_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a card smaller than the defaults were set for (1.5B's one pass of 64 sequences needs
    ~98 GiB; an H100 has 80), the bench retries with passes of half as many sequences and says so,
    instead of losing the model's figures. The out-of-memory error is injected (no GPU here)."""
    spec = importlib.util.spec_from_file_location("trainer_gpu_under_test", ROOT / "bench/gpu/trainer_gpu.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tried: list[int] = []

    def fits_in_passes_of_16(size: str, job: str, a: argparse.Namespace, *_: object) -> dict[str, int]:
        tried.append(a.micro_batch)
        if a.micro_batch > 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return {"micro_batch": a.micro_batch}

    monkeypatch.setattr(bench, "rlkube_grpo", fits_in_passes_of_16)
    cpu = torch.device("cpu")
    res = bench.grpo_fitting_memory("1.5b", "today", argparse.Namespace(micro_batch=64), cpu, {})
    assert tried == [64, 32, 16]
    assert res["micro_batch"] == 16 and res["micro_batch_fallback"]["asked"] == 64
    assert res["micro_batch_fallback"]["ran"] == 16

    def never_fits(size: str, job: str, a: argparse.Namespace, *_: object) -> dict[str, int]:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(bench, "rlkube_grpo", never_fits)
    with pytest.raises(torch.cuda.OutOfMemoryError):  # down to one sequence per pass, then the error
        bench.grpo_fitting_memory("1.5b", "today", argparse.Namespace(micro_batch=4), cpu, {})


def test_decode_step_bench_times_the_attention_kernel_alone_per_launch_setting(tmp_path: Path) -> None:
    """``--attention``: each launch setting and split of the kernel on the same inputs (groups
    sharing a prompt), the same output as the first setting, timed against the bytes it needs."""
    variants = ("default", "w2s2", "b32w4s2", "split64", "direct", "grouped")
    proc = run_bench(
        "decode_step_gpu.py", tmp_path, "--configs", "default", "--attention", ",".join(variants),
        "--attention-shapes", "b512,b512-long", "--no-capture-check", gpu_machine=True,
        env_extra={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "decode-step-gpu.json").read_text())
    rows = report["attention"]
    assert [(r["attention"], r["variant"]) for r in rows] == [
        (shape, v) for shape in ("b512", "b512-long") for v in variants
    ]
    assert all("error" not in r and r["us"] > 0 and r["bytes_needed"] > 0 for r in rows)
    assert all(r["max_abs_diff_vs_first"] < 1e-4 for r in rows)  # float32 on the CPU
    assert [r["split"] for r in rows[:5]] == [128, 128, 128, 64, 128]  # direct: the whole cache


def test_decode_step_bench_times_each_linear_layer_against_cublas_and_the_step_with_it_off(
    tmp_path: Path,
) -> None:
    """``--linear``: the four linear layers of a step, the unfused path and the fused kernel per
    launch setting, the same outputs; and the step A/B with the kernel (``linear``) and without
    (``cublas``); the other cuBLAS formulations (weight stored transposed, product then add,
    K in two halves) give the same outputs."""
    variants = ("default", "bn32", "2x", "t128", "wt", "mm-add", "split2", "bmm2", "gemm-only")
    proc = run_bench(
        "decode_step_gpu.py", tmp_path, "--configs", "linear,cublas", "--linear", ",".join(variants),
        "--linear-rows", "8,100", "--no-capture-check", gpu_machine=True, env_extra={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "decode-step-gpu.json").read_text())
    rows = [r for r in report["linear"] if "skipped" not in r]
    layers = ("q/k/v", "o", "gate/up", "down", "gated")
    residual = {"o", "down"}  # split-K (bmm2) applies to the GEMMs that add into the residual

    def applies(variant: str, layer: str) -> bool:
        if variant == "bmm2":
            return layer in residual
        if layer == "gated":  # gate/up after its norm: the kernel, the transposed weight, the bare GEMM
            return variant not in ("mm-add", "split2", "bmm2")
        return variant != "gemm-only"

    assert [(r["rows"], r["linear"], r["variant"]) for r in rows] == [
        (n, layer, v)
        for n in (8, 100)
        for layer in layers
        for v in ("cublas", *variants)
        if applies(v, layer)
    ]
    assert all("error" not in r and r["us"] > 0 and r["bytes_needed"] > 0 for r in rows)
    same_shape = [r for r in rows if r["variant"] != "gemm-only"]
    assert all(r["max_rel_diff_vs_cublas"] < 1e-5 for r in same_shape)  # float32 on the CPU
    # the bare GEMM (the floor of the fused SiLU) has the [rows, 2 I] shape: no diff to report
    assert all(r["max_rel_diff_vs_cublas"] is None for r in rows if r["variant"] == "gemm-only")
    assert all(r["fraction_of_gemm_rate"] > 0 for r in rows)
    steps = {r["config"]: r for r in report["results"]}
    assert steps["linear"]["linear"] == "triton" and steps["cublas"]["linear"] == "torch"


def test_overlap_bench_variants_compute_what_the_one_pass_step_does(tmp_path: Path) -> None:
    """The two-stream A/B's halves (each reading its groups' shared prompt from its own lead rows)
    and the folded MLP norm (weight in the GEMM, 1 / rms in the SiLU kernel) give the residual
    stream the all-rows pass gives, through the Triton kernels."""
    proc = run_bench("overlap_gpu.py", tmp_path, gpu_machine=True, env_extra={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "overlap-gpu.json").read_text())
    assert report["host_cpu"]  # a launch-bound peer's figure belongs to its host
    rows = report["results"]
    assert [r["variant"] for r in rows] == [
        *("one-stream", "halves-serial", "two-stream", "two-stream-lag", "fold-mlp-norm")
    ]
    assert all(r["max_abs_diff_vs_first"] < 1e-4 for r in rows)  # fp32 on the CPU
    assert all(r["bound_s"] == max(r["memory_s"], r["compute_s"]) for r in rows)
    assert all(0 < r["fraction_of_bound"] < 1 for r in rows)


def test_attention_variants_bench_matches_the_engine_kernel_and_times_each_part(tmp_path: Path) -> None:
    """``attention_variants_gpu.py``: the kernel's code variants give the engine kernel's output on
    the same inputs (the copy stop 42 took into the engine among them); the access pattern's own
    bound, the SiLU launches and the split-K GEMMs are timed alongside."""
    variants = ("prod", "direct", "early", "nomask", "twoloops", "headmajor", "stream")
    proc = run_bench(
        "attention_variants_gpu.py", tmp_path, "--contexts", "40", "--sizes", "1.5b",
        "--variants", ",".join(variants), "--parts", "attention,silu,gemm", gpu_machine=True,
        env_extra={"TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "attention-variants-gpu.json").read_text())
    rows = report["attention"]
    assert [r["variant"] for r in rows] == list(variants)
    assert all(r["us"] > 0 and r["fraction_of_read_bound"] > 0 for r in rows)
    assert all(r["max_abs_diff_vs_prod"] < 1e-4 for r in rows if r["variant"] != "stream")  # float32
    assert all(r["same_as_default"] for r in report["silu"] if r["silu"] == "plain")
    assert {r["gemm"] for r in report["gemm"]} >= {"o-addmm", "o-split2", "qkv-bias", "qkv-split2"}
