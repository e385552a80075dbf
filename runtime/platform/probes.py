"""What the hardware and its libraries report, each behind one small function.

These are the only places that touch torch's device runtime, the amdsmi package and the SMI
command-line tools, so tests fake exactly these reports and nothing else.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

# verl's list plus the PATH: CPU-only Ray actors often have a minimal PATH.
ROCM_SMI_DIRS: tuple[str, ...] = ("/usr/bin", "/usr/local/bin", "/opt/rocm/bin")
SMI_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class TorchReport:
    """torch's view: build flavour and the devices its runtime initialised."""

    importable: bool
    version: str | None = None
    hip: str | None = None
    cuda: str | None = None
    device_count: int = 0
    device_names: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class SmiReport:
    """A management library's or tool's view of the devices on the node."""

    source: str  # "amdsmi", "rocm-smi", "nvidia-smi"
    available: bool
    device_count: int = 0
    products: list[str] = field(default_factory=list)
    path: str | None = None
    error: str | None = None


def torch_report() -> TorchReport:
    """Import torch (if installed) and ask its accelerator runtime; never raises."""
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:  # not installed, or broken install
        return TorchReport(importable=False, error=f"{type(exc).__name__}: {exc}")
    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    count, names, error = 0, [], None
    if hip or cuda:
        try:
            count = int(torch.cuda.device_count())
            names = [str(torch.cuda.get_device_name(i)) for i in range(count)]
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    return TorchReport(True, str(torch.__version__), hip, cuda, count, names, error)


def amdsmi_report() -> SmiReport:
    """Devices per the amdsmi Python package (what Ray's AMD accelerator manager uses)."""
    try:
        amdsmi: Any = importlib.import_module("amdsmi")
    except Exception as exc:
        return SmiReport("amdsmi", False, error=f"{type(exc).__name__}: {exc}")
    try:
        amdsmi.amdsmi_init()
        try:
            handles = list(amdsmi.amdsmi_get_processor_handles())
            products = []
            for h in handles:
                try:
                    info = amdsmi.amdsmi_get_gpu_asic_info(h)
                    products.append(str(info.get("market_name") or info.get("name") or ""))
                except Exception:
                    products.append("")
        finally:
            amdsmi.amdsmi_shut_down()
    except Exception as exc:
        return SmiReport("amdsmi", False, error=f"{type(exc).__name__}: {exc}")
    return SmiReport("amdsmi", True, len(handles), products, path=getattr(amdsmi, "__file__", None))


def find_tool(name: str, extra_dirs: tuple[str, ...] | None = None) -> str | None:
    """`name` on PATH, else in the usual install dirs (ROCM_SMI_DIRS by default)."""
    found = shutil.which(name)
    if found:
        return found
    for d in ROCM_SMI_DIRS if extra_dirs is None else extra_dirs:
        cand = os.path.join(d, name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _run(cmd: list[str]) -> tuple[int, str, str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def parse_rocm_smi_json(text: str) -> list[str]:
    """Product names from `rocm-smi --showproductname --json`, one per card."""
    data = json.loads(text)
    products = []
    for key in sorted(k for k in data if k.lower().startswith("card")):
        card = data[key] if isinstance(data[key], dict) else {}
        products.append(str(card.get("Card Series") or card.get("Card SKU") or card.get("Card Model") or ""))
    return products


def rocm_smi_report() -> SmiReport:
    """Devices per `rocm-smi` (works without any Python GPU package)."""
    path = find_tool("rocm-smi")
    if path is None:
        return SmiReport("rocm-smi", False, error="rocm-smi not on PATH nor in " + ", ".join(ROCM_SMI_DIRS))
    try:
        rc, out, err = _run([path, "--showproductname", "--json"])
        if rc != 0:
            return SmiReport("rocm-smi", False, path=path, error=f"exit {rc}: {err.strip()[:300]}")
        products = parse_rocm_smi_json(out)
    except Exception as exc:
        return SmiReport("rocm-smi", False, path=path, error=f"{type(exc).__name__}: {exc}")
    return SmiReport("rocm-smi", True, len(products), products, path=path)


def nvidia_smi_report() -> SmiReport:
    """Devices per `nvidia-smi` (for torch-less actors on NVIDIA nodes)."""
    path = find_tool("nvidia-smi", ("/usr/bin", "/usr/local/bin", "/usr/local/nvidia/bin"))
    if path is None:
        return SmiReport("nvidia-smi", False, error="nvidia-smi not found")
    try:
        rc, out, err = _run([path, "--query-gpu=name", "--format=csv,noheader"])
        if rc != 0:
            return SmiReport("nvidia-smi", False, path=path, error=f"exit {rc}: {err.strip()[:300]}")
        products = [line.strip() for line in out.splitlines() if line.strip()]
    except Exception as exc:
        return SmiReport("nvidia-smi", False, path=path, error=f"{type(exc).__name__}: {exc}")
    return SmiReport("nvidia-smi", True, len(products), products, path=path)
