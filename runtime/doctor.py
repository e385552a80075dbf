"""`rlkube doctor`: what this pod or laptop can run, and why not.

Puts side by side what users otherwise debug for days on ROCm: the platform chosen and why, the
devices per torch vs amdsmi/rocm-smi vs Ray, the visibility masks, the engines installed, and a
diagnosis for each known trap. Exit code 1 when any problem of severity "error" is found, so it
doubles as the image's HEALTHCHECK.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkube.runtime.platform import PlatformError, VisibilityError, detect_platform, get_platform, probes

ENGINES = ("torch", "vllm", "sglang", "transformers", "ray")
VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Problem:
    code: str
    severity: str  # "error" fails the check, "warning" does not
    message: str
    fix: str


def engine_report(name: str, do_import: bool = False) -> dict[str, Any]:
    """Installed version (from package metadata) and, with `do_import`, whether it really imports."""
    dist = {"sglang": "sglang", "vllm": "vllm"}.get(name, name)
    out: dict[str, Any] = {"installed": importlib.util.find_spec(name) is not None, "version": None}
    for candidate in (dist, f"{dist}-cpu", f"{dist}-rocm"):
        try:
            out["version"] = importlib.metadata.version(candidate)
            out["distribution"] = candidate
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if do_import and out["installed"]:
        proc = subprocess.run(
            [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300, check=False
        )
        out["imports"] = proc.returncode == 0
        if proc.returncode:
            out["error"] = proc.stderr.strip().splitlines()[-1:] or ["import failed"]
    return out


def ray_report(address: str | None, local: bool) -> dict[str, Any]:
    """GPUs in `ray.cluster_resources()` of the given cluster, or of a short-lived local one."""
    if address is None and not local:
        return {"checked": False}
    try:
        import ray
    except Exception as exc:
        return {"checked": True, "error": f"ray not importable: {exc}"}
    try:
        if address is not None:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        else:
            ray.init(num_cpus=1, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
        res = ray.cluster_resources()
        return {
            "checked": True,
            "address": address or "local",
            "gpus": float(res.get("GPU", 0.0)),
            "resources": res,
        }
    except Exception as exc:
        return {"checked": True, "address": address or "local", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        if ray.is_initialized():
            ray.shutdown()


def collect(
    environ: Mapping[str, str] | None = None,
    ray_address: str | None = None,
    ray_local: bool = False,
    import_engines: bool = False,
    rljob: Any = None,
) -> dict[str, Any]:
    """Everything doctor looks at, as plain JSON-able data (``rljob``: an RLJob to size vLLM for)."""
    environ = os.environ if environ is None else environ
    report: dict[str, Any] = {}
    try:
        det = detect_platform(environ)
        plat = det.platform
        report["platform"] = {
            **plat.describe(),
            "forced": det.forced,
            "probes": {n: {"matched": p.matched, "reasons": p.reasons} for n, p in det.probes.items()},
        }
    except PlatformError as exc:
        plat = get_platform("cpu")
        report["platform"] = {"name": None, "error": str(exc)}
    report["devices"] = {
        "torch": dataclasses.asdict(probes.torch_report()),
        "amdsmi": dataclasses.asdict(probes.amdsmi_report()),
        "rocm_smi": dataclasses.asdict(probes.rocm_smi_report()),
        "nvidia_smi": dataclasses.asdict(probes.nvidia_smi_report()),
        "ray": ray_report(ray_address, ray_local),
    }
    vis: dict[str, Any] = {
        "vars": {v: environ.get(v) for v in VISIBILITY_VARS},
        "conflict": None,
        "changes": {},
    }
    try:
        vis["changes"] = plat.reconcile_visible_devices(environ)
    except VisibilityError as exc:
        vis["conflict"] = str(exc)
    report["visibility"] = vis
    report["ray_env"] = {k: environ.get(k) for k in plat.ray_noset_env()}
    report["engines"] = {e: engine_report(e, import_engines) for e in ENGINES}
    if plat.name == "cpu" and report["engines"]["vllm"]["installed"]:
        report["vllm_cpu"] = vllm_cpu_report(rljob)
    problems = diagnose(report)
    report["problems"] = [dataclasses.asdict(p) for p in problems]
    report["ok"] = not any(p.severity == "error" for p in problems)
    return report


def vllm_cpu_report(rljob: Any = None) -> dict[str, Any]:
    """Would vLLM's CPU backend fit in this node's free RAM with the job's (or the default) sizing?"""
    from rlkube.api import RolloutSpec
    from rlkube.runtime.rollout.sizing import GiB, cpu_memory_problem, host_memory

    mem = host_memory()
    ro = rljob.spec.rollout if rljob is not None else RolloutSpec()
    return {
        "source": "rljob" if rljob is not None else "defaults",
        "engine": ro.engine,
        "total_gib": round(mem.total / GiB, 2),
        "available_gib": round(mem.available / GiB, 2),
        "limit_gib": None if mem.limit is None else round(mem.limit / GiB, 2),
        "gpu_memory_utilization": ro.gpu_memory_utilization,
        "kv_cache_memory": ro.kv_cache_memory,
        "problem": cpu_memory_problem(ro.gpu_memory_utilization, ro.kv_cache_memory, mem),
    }


def diagnose(report: Mapping[str, Any]) -> list[Problem]:
    """The known traps, from a collected report. Pure: tests feed it reports directly too."""
    out: list[Problem] = []
    plat = report["platform"].get("name")
    dev = report["devices"]
    torch_r, amdsmi_r, rsmi_r, ray_r = dev["torch"], dev["amdsmi"], dev["rocm_smi"], dev["ray"]
    smi_count = max(amdsmi_r["device_count"], rsmi_r["device_count"], dev["nvidia_smi"]["device_count"])
    smi_name = (
        "amdsmi" if amdsmi_r["device_count"] else ("rocm-smi" if rsmi_r["device_count"] else "nvidia-smi")
    )
    vis = report["visibility"]
    if plat in ("amd", "nvidia") and report["platform"].get("forced") and not _probe_matched(report, plat):
        why = "; ".join(report["platform"].get("probes", {}).get(plat, {}).get("reasons", []))
        out.append(
            Problem(
                "FORCED_NO_GPUS",
                "error",
                f"RLKUBE_PLATFORM={plat} forces the {plat} platform but no {plat} GPU was found ({why}): "
                "GPU workers would fail or run on the CPU.",
                "Run on a node with the GPUs and drivers, or unset RLKUBE_PLATFORM so rlkube detects "
                "the platform.",
            )
        )
    if vis["conflict"]:
        out.append(Problem("VISIBILITY_CONFLICT", "error", vis["conflict"], "Keep one visibility variable."))
    if plat == "amd":
        rocr, hip = vis["vars"]["ROCR_VISIBLE_DEVICES"], vis["vars"]["HIP_VISIBLE_DEVICES"]
        if rocr is not None and hip is None and not vis["conflict"]:
            out.append(
                Problem(
                    "ROCR_WITHOUT_HIP",
                    "warning",
                    f"ROCR_VISIBLE_DEVICES={rocr!r} is set without HIP_VISIBLE_DEVICES: Ray's AMD GPU "
                    "manager raises 'Please use HIP_VISIBLE_DEVICES instead of ROCR_VISIBLE_DEVICES'.",
                    "Use HIP_VISIBLE_DEVICES (or CUDA_VISIBLE_DEVICES) instead.",
                )
            )
        empty = [k for k, v in vis["vars"].items() if v is not None and not v.strip()]
        if empty:
            out.append(
                Problem(
                    "VISIBILITY_EMPTY",
                    "error",
                    f"{', '.join(empty)} set to an empty string: every GPU is hidden from this process.",
                    "Unset the variable or list device ids.",
                )
            )
        if torch_r["importable"] and torch_r["hip"] and torch_r["device_count"] == 0 and smi_count > 0:
            out.append(
                Problem(
                    "TORCH_ZERO_GPUS",
                    "error",
                    f"torch (HIP {torch_r['hip']}) sees 0 GPUs while {smi_name} lists {smi_count}. "
                    "On TheRock-based ROCm images this is the rocm_sdk library preload with RTLD_GLOBAL "
                    "making "
                    "torch.cuda.device_count() collapse to 0; otherwise check /dev/kfd and /dev/dri access "
                    "(video/render groups) and the visibility masks.",
                    "Preload the ROCm SDK libraries with RTLD_LOCAL (Dockerfile.rocm does).",
                )
            )
        if torch_r["importable"] and not torch_r["hip"] and _probe_matched(report, "amd"):
            out.append(
                Problem(
                    "TORCH_NOT_ROCM",
                    "error",
                    f"AMD GPUs found ({'; '.join(report['platform'].get('reasons', []))}) but torch "
                    f"{torch_r['version']} is not a ROCm build: trainers would run on the CPU.",
                    "Install a ROCm torch build (the rocm/primus base image ships one).",
                )
            )
        if not amdsmi_r["available"] and (rsmi_r["device_count"] or torch_r["device_count"]):
            out.append(
                Problem(
                    "AMDSMI_MISSING",
                    "error",
                    f"the amdsmi Python package is not usable ({amdsmi_r['error']}) although GPUs are "
                    "present: Ray's AMD accelerator detection then reports 0 GPUs and placement fails with "
                    "'Total available GPUs 0 is less than total desired GPUs'.",
                    "pip install the amdsmi package bundled with ROCm (/opt/rocm/share/amd_smi); "
                    "Dockerfile.rocm does.",
                )
            )
        missing_noset = [k for k, v in report.get("ray_env", {}).items() if v != "1"]
        if missing_noset:
            out.append(
                Problem(
                    "RAY_NOSET_MISSING",
                    "warning",
                    f"{', '.join(missing_noset)} not set: Ray rewrites HIP/CUDA masks per actor and "
                    "fights the runtime's own visibility management ('No HIP GPUs are available').",
                    "Set them before `ray start` (the rlkube operator and image do).",
                )
            )
    expected = max(smi_count, torch_r["device_count"])
    if ray_r.get("checked"):
        if ray_r.get("error"):
            out.append(Problem("RAY_UNREACHABLE", "error", f"Ray: {ray_r['error']}", "Check --ray-address."))
        elif ray_r.get("gpus", 0.0) == 0.0 and plat in ("amd", "nvidia") and expected > 0:
            out.append(
                Problem(
                    "RAY_ZERO_GPUS",
                    "error",
                    f"Ray reports 0 GPUs while this node has {expected} ({smi_name}/torch): jobs asking for "
                    "num_gpus will never be scheduled.",
                    "On AMD: install amdsmi and keep ROCR_VISIBLE_DEVICES unset; set num-gpus explicitly in "
                    "`ray start` for partition resources (amd.com/cpx_*).",
                )
            )
    vc = report.get("vllm_cpu")
    if vc and vc.get("problem") and (vc["source"] == "defaults" or vc["engine"] == "vllm"):
        from_job = vc["source"] == "rljob"
        out.append(
            Problem(
                "VLLM_CPU_MEMORY",
                "error" if from_job else "warning",
                vc["problem"] + ("" if from_job else " (rlkube's default sizing; check a job with --rljob)"),
                "Set rollout.kvCacheMemory (e.g. 1Gi) or a lower rollout.gpuMemoryUtilization.",
            )
        )
    if plat in ("amd", "nvidia") and not torch_r["importable"]:
        out.append(
            Problem("TORCH_MISSING", "warning", f"torch not importable: {torch_r['error']}", "Install torch.")
        )
    return out


def _probe_matched(report: Mapping[str, Any], name: str) -> bool:
    """Did the platform's own probe find its GPUs (a forced platform skips the verdict, not the probe)?"""
    return bool(report["platform"].get("probes", {}).get(name, {}).get("matched", True))


def render_text(report: Mapping[str, Any]) -> str:
    """A short human-readable summary."""
    p = report["platform"]
    d = report["devices"]
    lines = [f"platform: {p.get('name')} ({p.get('product') or 'no product name'})"]
    lines += [f"  why: {r}" for r in p.get("reasons", [])]
    lines.append(
        "devices: torch={} amdsmi={} rocm-smi={} nvidia-smi={} ray={}".format(
            d["torch"]["device_count"],
            d["amdsmi"]["device_count"] if d["amdsmi"]["available"] else "n/a",
            d["rocm_smi"]["device_count"] if d["rocm_smi"]["available"] else "n/a",
            d["nvidia_smi"]["device_count"] if d["nvidia_smi"]["available"] else "n/a",
            d["ray"].get("gpus", "not checked") if d["ray"].get("checked") else "not checked",
        )
    )
    set_vars = {k: v for k, v in report["visibility"]["vars"].items() if v is not None}
    lines.append(f"visibility: {set_vars or 'no masks set'}")
    eng = ", ".join(
        f"{k} {v['version']}" if v["installed"] else f"{k} -" for k, v in report["engines"].items()
    )
    lines.append(f"engines: {eng}")
    vc = report.get("vllm_cpu")
    if vc:
        sizing = (
            f"kvCacheMemory {vc['kv_cache_memory']}"
            if vc["kv_cache_memory"]
            else (f"gpuMemoryUtilization {vc['gpu_memory_utilization']}")
        )
        lines.append(
            f"vllm on cpu ({vc['source']}): {sizing}; node RAM {vc['total_gib']} GiB, free "
            f"{vc['available_gib']} GiB" + (f", pod limit {vc['limit_gib']} GiB" if vc["limit_gib"] else "")
        )
    for pr in report["problems"]:
        lines.append(f"{pr['severity'].upper()} {pr['code']}: {pr['message']}\n  fix: {pr['fix']}")
    lines.append("OK" if report["ok"] else "PROBLEMS FOUND")
    return "\n".join(lines)


def run(args: Any) -> int:
    """Entry for `rlkube doctor`."""
    job = None
    if args.rljob is not None:
        from rlkube.api import load_rljob, resolve

        job = resolve(load_rljob(args.rljob))
    report = collect(
        ray_address=args.ray_address,
        ray_local=args.ray_local,
        import_engines=args.import_engines,
        rljob=job,
    )
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render_text(report) + "\n")
    return 0 if report["ok"] else 1


def add_parser(sub: Any) -> None:
    """Register the `doctor` subcommand on an argparse subparsers object."""
    p = sub.add_parser("doctor", help="check GPUs, visibility, Ray and engines; exit 1 on a problem")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ray-address", default=None, help="check GPUs of this running Ray cluster")
    g.add_argument("--ray-local", action="store_true", help="start a short-lived local Ray to check its GPUs")
    p.add_argument("--import-engines", action="store_true", help="really import each engine (slow)")
    p.add_argument(
        "--rljob", type=Path, default=None, help="also check this RLJob's rollout sizing against this machine"
    )
    p.set_defaults(func=run)
