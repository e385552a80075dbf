"""The platform layer on this CPU machine, with ROCm hardware reports faked (see conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import write_rocm_smi

from rlkube.api import platform_env as env
from rlkube.runtime.platform import (
    CpuPlatform,
    CudaPlatform,
    Platform,
    PlatformError,
    ProbeResult,
    RocmPlatform,
    VisibilityError,
    base,
    current_platform,
    detect_platform,
    get_platform,
    register_platform,
    registered_platforms,
)

REPO = Path(__file__).resolve().parents[2]


def test_plain_cpu_machine_falls_back_to_cpu_and_says_why() -> None:
    det = detect_platform()
    assert det.platform.name == "cpu" and not det.forced
    assert det.platform.communication_backend == "gloo"
    assert det.platform.peak_flops() is None and det.platform.ray_options(1) == {}
    assert not det.probes["amd"].matched and not det.probes["nvidia"].matched
    why = " ".join(det.probes["amd"].reasons)
    assert "amdsmi" in why and "rocm-smi" in why


def test_rocm_torch_build_selects_amd_and_cuda_never_claims_it(fake_hip: Callable[..., None]) -> None:
    fake_hip(8)
    det = detect_platform()
    p = det.platform
    assert isinstance(p, RocmPlatform) and isinstance(p, CudaPlatform)
    assert (p.vendor, p.device_name, p.communication_backend) == ("amd", "cuda", "nccl")
    assert p.device_count() == 8
    assert p.peak_flops() == 1307e12
    assert p.ray_options(1) == {"num_gpus": 1}
    probe = CudaPlatform.probe()  # torch.version.cuda is set on this build and 8 GPUs are "visible"
    assert not probe.matched and "ROCm build" in probe.reasons[0]


def test_amdsmi_alone_finds_gpus_in_a_torch_cpu_actor(fake_amdsmi: Callable[..., None]) -> None:
    fake_amdsmi(8, "AMD Instinct MI355X")
    p = detect_platform().platform
    assert p.name == "amd" and p.device_count() == 8
    assert p.product_name() == "AMD Instinct MI355X" and p.peak_flops() == 2500e12
    assert any("amdsmi lists 8" in r for r in p.probe_result.reasons)


def test_rocm_smi_on_path_alone_finds_gpus(
    fake_rocm_smi: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = fake_rocm_smi(8, "AMD Instinct MI350X")
    p = detect_platform().platform
    assert p.name == "amd" and p.device_count() == 8 and p.peak_flops() == 2300e12
    assert any(str(script) in r for r in p.probe_result.reasons)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")  # a torch-less actor given two GPUs
    assert p.device_count() == 2


def test_rocm_smi_in_opt_rocm_is_found_without_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_rocm_smi(tmp_path / "opt" / "rocm" / "bin", 4)
    from rlkube.runtime.platform import probes

    monkeypatch.setattr(probes, "ROCM_SMI_DIRS", (str(tmp_path / "opt" / "rocm" / "bin"),))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert probes.rocm_smi_report().device_count == 4
    assert detect_platform().platform.name == "amd"


def test_override_selects_platform_and_rejects_unknown(
    fake_hip: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_hip(8)
    monkeypatch.setenv("RLKUBE_PLATFORM", "cpu")
    det = detect_platform()
    assert det.forced and det.platform.name == "cpu"
    assert "RLKUBE_PLATFORM=cpu" in det.platform.probe_result.reasons[0]
    assert current_platform().name == "cpu"
    monkeypatch.setenv("RLKUBE_PLATFORM", "tpu")
    with pytest.raises(PlatformError, match="'tpu' is not a registered platform"):
        detect_platform()
    monkeypatch.setenv("RLKUBE_PLATFORM", "AMD")
    assert detect_platform().platform.name == "amd"


@pytest.mark.parametrize(
    ("environ", "changes"),
    [
        ({}, {}),
        ({"HIP_VISIBLE_DEVICES": "2,3"}, {"CUDA_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": None}),
        (
            {"HIP_VISIBLE_DEVICES": "0, 1", "CUDA_VISIBLE_DEVICES": "0,1"},
            {"CUDA_VISIBLE_DEVICES": "0, 1", "HIP_VISIBLE_DEVICES": None},
        ),
        ({"CUDA_VISIBLE_DEVICES": "4"}, {}),
        ({"ROCR_VISIBLE_DEVICES": "0,1"}, {}),
    ],
)
def test_rocm_visibility_moves_hip_into_cuda(environ: dict[str, str], changes: dict[str, str | None]) -> None:
    assert RocmPlatform().reconcile_visible_devices(environ) == changes


def test_rocm_visibility_conflicts_are_errors_with_a_fix() -> None:
    p = RocmPlatform()
    with pytest.raises(VisibilityError, match="disagree") as exc:
        p.reconcile_visible_devices({"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "1"})
    assert "Set only one" in str(exc.value)
    for other in ({"HIP_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}):
        with pytest.raises(VisibilityError, match="Unset ROCR_VISIBLE_DEVICES"):
            p.reconcile_visible_devices({"ROCR_VISIBLE_DEVICES": "0", **other})


def test_apply_visible_devices_edits_the_environment() -> None:
    environ = {"HIP_VISIBLE_DEVICES": "5"}
    RocmPlatform().apply_visible_devices(environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": "5"}


def test_rocm_process_env_makes_the_decisions_explicit() -> None:
    p = RocmPlatform(ProbeResult(True))
    sg = p.engine_env("sglang", base={})
    assert sg["SGLANG_ATTENTION_BACKEND"] == "triton" and sg["SGLANG_USE_AITER"] == "0"
    opt_in = p.engine_env("sglang", base={"SGLANG_USE_AITER": "1"})
    assert opt_in["SGLANG_USE_AITER"] == "1"  # the user's opt-in wins
    vl = p.engine_env("vllm", base={})
    assert vl["VLLM_ROCM_USE_AITER"] == "1"
    assert p.engine_args("vllm") == {"disable_custom_all_reduce": True}
    assert p.engine_args("sglang") == {"disable_custom_all_reduce": True, "attention_backend": "triton"}
    tr = p.trainer_env(base={})
    assert tr["HSA_NO_SCRATCH_RECLAIM"] == "1" and tr["NCCL_CUMEM_ENABLE"] == "0"
    noset = p.ray_noset_env()
    assert {f"RAY_EXPERIMENTAL_NOSET_{v}_VISIBLE_DEVICES" for v in ("HIP", "ROCR", "CUDA")} <= set(noset)
    for e in ("vllm", "sglang", "hf"):
        full = env.ray_container_env("amd", e)
        assert "ROCR_VISIBLE_DEVICES" not in full and full["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"
    assert p.ray_runtime_env("vllm")["env_vars"]["VLLM_ROCM_USE_AITER"] == "1"
    nv = CudaPlatform(ProbeResult(True))
    assert "VLLM_ROCM_USE_AITER" not in nv.engine_env("vllm", base={})
    assert CpuPlatform().engine_env("vllm", base={}) == {}


def test_env_tables_reject_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown rollout engine"):
        env.ray_container_env("amd", "trtllm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no GPU resource"):
        env.gpu_resource_name("cpu")
    assert env.gpu_resource_name("amd") == "amd.com/gpu"


@pytest.mark.parametrize(
    ("product", "flops"),
    [
        ("AMD Instinct MI300X OAM", 1307e12),
        ("AMD Instinct MI325X", 1307e12),
        ("AMD Instinct MI350X", 2300e12),
        ("AMD Instinct MI355X", 2500e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("Some Future GPU", None),
    ],
)
def test_peak_flops_by_product(product: str, flops: float | None, fake_hip: Callable[..., None]) -> None:
    fake_hip(1, product)
    assert detect_platform().platform.peak_flops() == flops


def test_third_party_platform_via_decorator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))

    @register_platform
    class FakeNpu(Platform):
        name = "npu"
        vendor = "cpu"
        device_name = "npu"
        ray_resource_name = "NPU"
        communication_backend = "hccl"
        priority = 50

        @classmethod
        def probe(cls) -> ProbeResult:
            return ProbeResult(True, ["npu-smi lists 4"], device_count=4)

    p = detect_platform().platform
    assert p.name == "npu" and p.device_count() == 4
    assert p.ray_options(2) == {"resources": {"NPU": 2}}
    assert get_platform("cpu").name == "cpu"


def test_third_party_platform_via_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "acme_platform.py").write_text(
        textwrap.dedent(
            """
            from rlkube.runtime.platform import Platform, ProbeResult

            class AcmePlatform(Platform):
                name = "acme"
                priority = -1

                @classmethod
                def probe(cls):
                    return ProbeResult(False, ["no acme"])
            """
        )
    )
    info = tmp_path / "acme_platform-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-platform\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rlkube.platforms]\nacme = acme_platform:AcmePlatform\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setattr(base, "_entry_points_loaded", False)
    assert "acme" in registered_platforms()
    monkeypatch.setenv("RLKUBE_PLATFORM", "acme")
    assert detect_platform().platform.name == "acme"


def test_env_tables_import_without_torch_and_print_the_image_env() -> None:
    code = (
        "import sys, rlkube.runtime.platform, rlkube.api.platform_env as e;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "print(e.ray_container_env('amd', 'sglang')['SGLANG_ATTENTION_BACKEND'])"
    )
    envv = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=envv, check=True)
    assert out.stdout.strip() == "triton"
    out = subprocess.run(
        [sys.executable, "-m", "rlkube.runtime.platform", "--dockerfile-env"],
        capture_output=True,
        text=True,
        env=envv,
        check=True,
        cwd=REPO,
    )
    assert out.stdout.startswith("ENV ") and 'HSA_NO_SCRATCH_RECLAIM="1"' in out.stdout
