"""`rlkube doctor` run for real as a subprocess: on this CPU machine, and with ROCm reports faked
(a ROCm torch build via sitecustomize, an amdsmi package, a rocm-smi on PATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import AMDSMI_SOURCE, SITECUSTOMIZE, write_rocm_smi

RLKUBE = str(Path(sys.executable).with_name("rlkube"))
NOSET = {
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1",
}


def doctor(
    tmp_path: Path,
    *args: str,
    torch_gpus: int | None = None,
    amdsmi_gpus: int | None = None,
    rocm_smi_gpus: int | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """Run `rlkube doctor` with only the named hardware reports faked; JSON report unless --text."""
    fakes = tmp_path / "fakes"
    fakes.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.endswith("VISIBLE_DEVICES")}
    env.pop("RLKUBE_PLATFORM", None)
    env.update({"PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"})
    pythonpath = []
    if torch_gpus is not None:
        (fakes / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env.update({"FAKE_HIP": "6.4.43482", "FAKE_TORCH_GPUS": str(torch_gpus)})
        pythonpath.append(str(fakes))
    if amdsmi_gpus is not None:
        (fakes / "amdsmi").mkdir(exist_ok=True)
        (fakes / "amdsmi" / "__init__.py").write_text(AMDSMI_SOURCE)
        env["FAKE_AMDSMI_GPUS"] = str(amdsmi_gpus)
        pythonpath.append(str(fakes))
    if rocm_smi_gpus is not None:
        script = write_rocm_smi(tmp_path / "bin", rocm_smi_gpus)
        env["PATH"] = f"{script.parent}{os.pathsep}{env.get('PATH', '')}"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pythonpath))
    env.update(extra_env or {})
    text = "--text" in args
    argv = [RLKUBE, "doctor", *(a for a in args if a != "--text")]
    if not text:
        argv.append("--json")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, proc.stdout if text else json.loads(proc.stdout)


def codes(report: dict[str, Any]) -> set[str]:
    return {p["code"] for p in report["problems"]}


def test_cpu_machine_is_healthy_and_report_has_every_section(tmp_path: Path) -> None:
    # A 1 GiB vLLM KV cache fits this machine whatever else runs on it (the default sizing, 0.6 of
    # the RAM, depends on the load of the moment and would be a warning when it does not fit).
    rc, rep = doctor(tmp_path, extra_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert rc == 0 and rep["ok"] is True and rep["problems"] == []
    assert rep["vllm_cpu"]["source"] == "defaults" and rep["vllm_cpu"]["problem"] is None
    assert rep["platform"]["name"] == "cpu" and rep["platform"]["communication_backend"] == "gloo"
    assert set(rep["platform"]["probes"]) == {"amd", "nvidia", "cpu"}
    assert set(rep["devices"]) == {"torch", "amdsmi", "rocm_smi", "nvidia_smi", "ray"}
    assert rep["devices"]["torch"]["importable"] and rep["devices"]["torch"]["hip"] is None
    assert rep["devices"]["ray"] == {"checked": False}
    assert rep["engines"]["vllm"]["version"] == "0.32.0" and rep["engines"]["sglang"]["installed"] is False
    assert rep["engines"]["torch"]["installed"] and rep["engines"]["ray"]["version"] == "2.60.0"
    masks = {"CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
    assert set(rep["visibility"]["vars"]) == masks


def test_healthy_fake_amd_node(tmp_path: Path) -> None:
    rc, rep = doctor(tmp_path, torch_gpus=8, amdsmi_gpus=8, rocm_smi_gpus=8, extra_env=NOSET)
    assert rc == 0, rep["problems"]
    assert rep["platform"]["name"] == "amd" and rep["platform"]["product"] == "AMD Instinct MI300X OAM"
    assert rep["platform"]["peak_bf16_flops"] == 1307e12
    d = rep["devices"]
    assert [d[k]["device_count"] for k in ("torch", "amdsmi", "rocm_smi")] == [8, 8, 8]


def test_torch_sees_zero_while_smi_lists_gpus_and_amdsmi_missing(tmp_path: Path) -> None:
    """The seed's TheRock bring-up bug: RTLD_GLOBAL preload + no amdsmi package."""
    rc, rep = doctor(tmp_path, torch_gpus=0, rocm_smi_gpus=8, extra_env=NOSET)
    assert rc == 1 and not rep["ok"]
    assert {"TORCH_ZERO_GPUS", "AMDSMI_MISSING"} <= codes(rep)
    msg = next(p for p in rep["problems"] if p["code"] == "TORCH_ZERO_GPUS")
    assert "RTLD_GLOBAL" in msg["message"] and "rocm-smi lists 8" in msg["message"]
    rc, out = doctor(tmp_path, "--text", torch_gpus=0, rocm_smi_gpus=8, extra_env=NOSET)
    assert rc == 1 and "ERROR TORCH_ZERO_GPUS" in out and "PROBLEMS FOUND" in out


def test_rocr_with_hip_is_a_visibility_conflict(tmp_path: Path) -> None:
    env = {**NOSET, "HIP_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0,1"}
    rc, rep = doctor(tmp_path, torch_gpus=2, amdsmi_gpus=8, extra_env=env)
    assert rc == 1 and codes(rep) == {"VISIBILITY_CONFLICT"}
    assert "Unset ROCR_VISIBLE_DEVICES" in rep["visibility"]["conflict"]


def test_torch_not_rocm_and_missing_noset_vars(tmp_path: Path) -> None:
    rc, rep = doctor(tmp_path, amdsmi_gpus=8)  # this machine's torch is a CUDA/CPU build
    assert rc == 1 and rep["platform"]["name"] == "amd"
    assert "TORCH_NOT_ROCM" in codes(rep)
    sev = {p["code"]: p["severity"] for p in rep["problems"]}
    assert sev["RAY_NOSET_MISSING"] == "warning"


@pytest.mark.ray
def test_ray_reporting_zero_gpus_is_diagnosed(tmp_path: Path) -> None:
    """A real local Ray on this CPU machine finds no GPUs while the (faked) SMI lists 8."""
    rc, rep = doctor(tmp_path, "--ray-local", torch_gpus=8, amdsmi_gpus=8, extra_env=NOSET)
    assert rep["devices"]["ray"]["checked"] and rep["devices"]["ray"]["gpus"] == 0.0
    assert rc == 1 and codes(rep) == {"RAY_ZERO_GPUS"}


def test_forcing_amd_on_a_machine_without_gpus_says_none_were_found(tmp_path: Path) -> None:
    rc, rep = doctor(tmp_path, extra_env={"RLKUBE_PLATFORM": "amd"})
    assert rc == 1 and rep["platform"]["name"] == "amd" and rep["platform"]["forced"]
    forced = next(p for p in rep["problems"] if p["code"] == "FORCED_NO_GPUS")
    assert "no amd GPU was found" in forced["message"] and "unset RLKUBE_PLATFORM" in forced["fix"]
    assert not [p for p in rep["problems"] if "GPUs found" in p["message"]], rep["problems"]
    rc, out = doctor(tmp_path, "--text", extra_env={"RLKUBE_PLATFORM": "amd"})
    assert "ERROR FORCED_NO_GPUS" in out and "AMD GPUs found" not in out
