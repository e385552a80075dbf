"""Fakes of what ROCm hardware reports, and nothing else: torch.version.hip and its device count,
an `amdsmi` module listing devices, a `rocm-smi` executable on PATH. The platform code under test
is the real one."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from rlkube.runtime.platform import reset_current_platform

torch.set_num_threads(1)

PRODUCT = "AMD Instinct MI300X OAM"

AMDSMI_SOURCE = textwrap.dedent(
    '''
    """Fake amdsmi: the subset of the real package's API that rlkube and Ray's detection call."""
    import os
    _N = int(os.environ.get("FAKE_AMDSMI_GPUS", "8"))
    _PRODUCT = os.environ.get("FAKE_PRODUCT", "AMD Instinct MI300X OAM")
    def amdsmi_init(*a, **k): pass
    def amdsmi_shut_down(): pass
    def amdsmi_get_processor_handles(): return [f"handle{i}" for i in range(_N)]
    def amdsmi_get_gpu_asic_info(h): return {"market_name": _PRODUCT, "target_graphics_version": "gfx942"}
    '''
)

SITECUSTOMIZE = textwrap.dedent(
    '''
    """Fake a ROCm torch build in subprocesses: only what the hardware/runtime reports."""
    import os
    import sys
    # Only in the doctor process itself: Ray's own helper processes must start fast.
    if os.environ.get("FAKE_HIP") and os.path.basename(sys.argv[0] if sys.argv else "") == "rlkube":
        import torch
        torch.version.hip = os.environ["FAKE_HIP"]
        _n = int(os.environ.get("FAKE_TORCH_GPUS", "0"))
        torch.cuda.device_count = lambda: _n
        torch.cuda.get_device_name = lambda i=0: os.environ.get("FAKE_PRODUCT", "AMD Instinct MI300X OAM")
    '''
)


def rocm_smi_json(n: int, product: str = PRODUCT) -> str:
    return json.dumps({f"card{i}": {"Card Series": product, "GFX Version": "gfx942"} for i in range(n)})


def write_rocm_smi(bindir: Path, n: int, product: str = PRODUCT) -> Path:
    bindir.mkdir(parents=True, exist_ok=True)
    script = bindir / "rocm-smi"
    # Python, not sh: it must run with an empty PATH too.
    script.write_text(f"#!{sys.executable}\nprint({rocm_smi_json(n, product)!r})\n")
    script.chmod(0o755)
    return script


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in (
        "RLKUBE_PLATFORM",
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "SGLANG_USE_AITER",
    ):
        monkeypatch.delenv(var, raising=False)
    reset_current_platform()
    yield
    reset_current_platform()


@pytest.fixture
def fake_hip(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """torch reports a ROCm build with `n` visible GPUs."""

    def install(n: int, product: str = PRODUCT) -> None:
        monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: product)

    return install


@pytest.fixture
def fake_amdsmi(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """An importable `amdsmi` listing `n` devices."""

    def install(n: int = 8, product: str = PRODUCT) -> None:
        monkeypatch.setenv("FAKE_AMDSMI_GPUS", str(n))
        monkeypatch.setenv("FAKE_PRODUCT", product)
        mod = types.ModuleType("amdsmi")
        exec(compile(AMDSMI_SOURCE, "<fake amdsmi>", "exec"), mod.__dict__)
        monkeypatch.setitem(sys.modules, "amdsmi", mod)

    return install


@pytest.fixture
def fake_rocm_smi(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[int], Path]:
    """A `rocm-smi` on PATH listing `n` cards."""

    def install(n: int = 8, product: str = PRODUCT) -> Path:
        script = write_rocm_smi(tmp_path / "bin", n, product)
        monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        return script

    return install
