"""The built-in platforms: ROCm (AMD), CUDA (NVIDIA) and CPU."""

from __future__ import annotations

import os
from collections.abc import Mapping

from rlkube.runtime.platform import probes
from rlkube.runtime.platform.base import Platform, ProbeResult, VisibilityError, parse_mask, register_platform


@register_platform
class CpuPlatform(Platform):
    """Always available; the fallback when no accelerator is found."""

    name = "cpu"
    vendor = "cpu"
    device_name = "cpu"
    visible_devices_var = None
    ray_resource_name = None
    communication_backend = "gloo"
    priority = -100

    @classmethod
    def probe(cls) -> ProbeResult:
        return ProbeResult(True, ["no accelerator platform matched; using the CPU"], device_count=0)

    def device_count(self) -> int:
        return 0

    def peak_flops(self, dtype: str = "bf16") -> float | None:
        return None


@register_platform
class CudaPlatform(Platform):
    """NVIDIA GPUs through torch.cuda."""

    name = "nvidia"
    vendor = "nvidia"
    device_name = "cuda"
    visible_devices_var = "CUDA_VISIBLE_DEVICES"
    ray_resource_name = "GPU"
    communication_backend = "nccl"
    priority = 10

    @classmethod
    def probe(cls) -> ProbeResult:
        t = probes.torch_report()
        if t.importable and t.hip:
            # torch on ROCm also answers to torch.cuda: never claim it.
            return ProbeResult(False, [f"torch.version.hip={t.hip}: a ROCm build, not CUDA"])
        if t.importable and t.cuda and t.device_count > 0:
            return ProbeResult(
                True,
                [f"torch.version.cuda={t.cuda} and torch sees {t.device_count} GPU(s)"],
                t.device_count,
                t.device_names[0] if t.device_names else None,
            )
        smi = probes.nvidia_smi_report()
        if smi.available and smi.device_count > 0:
            return ProbeResult(
                True,
                [f"nvidia-smi at {smi.path} lists {smi.device_count} GPU(s)"],
                smi.device_count,
                smi.products[0] if smi.products else None,
            )
        why = [f"torch.version.cuda={t.cuda}, torch sees {t.device_count} GPU(s)", f"nvidia-smi: {smi.error}"]
        return ProbeResult(False, why)


@register_platform
class RocmPlatform(CudaPlatform):
    """AMD GPUs. PyTorch on ROCm exposes HIP as torch.cuda, so most of CUDA's answers hold."""

    name = "amd"
    vendor = "amd"
    device_name = "cuda"
    visible_devices_var = "CUDA_VISIBLE_DEVICES"  # where HIP_VISIBLE_DEVICES is moved to
    ray_resource_name = "GPU"
    communication_backend = "nccl"  # RCCL answers to "nccl"
    priority = 20

    @classmethod
    def probe(cls) -> ProbeResult:
        """torch.version.hip first, then amdsmi, then rocm-smi: the last two work in torch-less actors."""
        reasons: list[str] = []
        t = probes.torch_report()
        if t.importable and t.hip:
            product = t.device_names[0] if t.device_names else None
            if product is None:
                product = _smi_product()
            reasons.append(f"torch.version.hip={t.hip}; torch sees {t.device_count} GPU(s)")
            return ProbeResult(True, reasons, t.device_count, product)
        reasons.append("torch is not a ROCm build" if t.importable else f"torch not importable ({t.error})")
        a = probes.amdsmi_report()
        if a.available and a.device_count > 0:
            reasons.append(f"amdsmi lists {a.device_count} GPU(s)")
            return ProbeResult(True, reasons, a.device_count, a.products[0] if a.products else None)
        reasons.append(f"amdsmi: {a.error or 'no devices'}")
        r = probes.rocm_smi_report()
        if r.available and r.device_count > 0:
            reasons.append(f"rocm-smi at {r.path} lists {r.device_count} GPU(s)")
            return ProbeResult(True, reasons, r.device_count, r.products[0] if r.products else None)
        reasons.append(f"rocm-smi: {r.error or 'no devices'}")
        return ProbeResult(False, reasons)

    def reconcile_visible_devices(self, environ: Mapping[str, str]) -> dict[str, str | None]:
        """HIP_VISIBLE_DEVICES moves into CUDA_VISIBLE_DEVICES; ROCR with either is refused.

        One variable, CUDA_VISIBLE_DEVICES, then carries the mask, so later rewrites by vLLM or
        Ray are not compounded with a stale HIP mask (the "No HIP GPUs are available" trap).
        """
        hip = environ.get("HIP_VISIBLE_DEVICES")
        cuda = environ.get("CUDA_VISIBLE_DEVICES")
        rocr = environ.get("ROCR_VISIBLE_DEVICES")
        if rocr is not None and (hip is not None or cuda is not None):
            pairs = (("HIP_VISIBLE_DEVICES", hip), ("CUDA_VISIBLE_DEVICES", cuda))
            others = ", ".join(f"{k}={v!r}" for k, v in pairs if v is not None)
            raise VisibilityError(
                f"ROCR_VISIBLE_DEVICES={rocr!r} is set together with {others}: ROCR masks at the driver "
                "level and HIP/CUDA masks re-index on top of it, so device ids no longer mean what you "
                "think (Ray refuses this too). Unset ROCR_VISIBLE_DEVICES and keep only "
                "HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES."
            )
        if hip is None:
            return {}
        if cuda is not None and parse_mask(cuda) != parse_mask(hip):
            raise VisibilityError(
                f"HIP_VISIBLE_DEVICES={hip!r} and CUDA_VISIBLE_DEVICES={cuda!r} disagree: the HIP runtime "
                "applies both, so the devices you get are neither. Set only one of them."
            )
        return {"CUDA_VISIBLE_DEVICES": hip, "HIP_VISIBLE_DEVICES": None}

    def device_count(self) -> int:
        """torch's count where torch is a ROCm build, else the SMI count narrowed by the mask."""
        count = self.probe_result.device_count or 0
        t = probes.torch_report()
        if t.importable and t.hip:
            return t.device_count
        for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
            mask = parse_mask(os.environ.get(var))
            if mask is not None:
                return min(count, len(mask))
        return count


def _smi_product() -> str | None:
    a = probes.amdsmi_report()
    if a.available and a.products:
        return a.products[0]
    r = probes.rocm_smi_report()
    if r.available and r.products:
        return r.products[0]
    return None
