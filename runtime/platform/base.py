"""The Platform interface, the registry and platform selection.

Everything that differs between ROCm, CUDA and CPU is answered by one `Platform` object, so
callers never branch on `torch.version.hip` themselves. Probing imports torch lazily and only
where needed: CPU-only Ray actors (torch without GPU, or no torch at all) can still ask.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, ClassVar

from rlkube.api import platform_env as envtables
from rlkube.api.contract import Engine, Vendor

PLATFORM_ENV_VAR = "RLKUBE_PLATFORM"
ENTRY_POINT_GROUP = "rlkube.platforms"


class PlatformError(RuntimeError):
    """No platform matches, or the one asked for is unknown."""


class VisibilityError(ValueError):
    """Device visibility variables conflict; the message says which and how to fix it."""


@dataclass(frozen=True)
class ProbeResult:
    """Whether a platform matched and the evidence, in words a user can check."""

    matched: bool
    reasons: list[str] = field(default_factory=list)
    device_count: int | None = None
    product: str | None = None


# Dense bf16 peak FLOP/s per device (vendor figures, no sparsity), longest key first when matching.
PEAK_BF16_FLOPS: dict[str, float] = {
    "MI355X": 2500e12,
    "MI350X": 2300e12,
    "MI325X": 1307e12,
    "MI300X": 1307e12,
    "MI300A": 980.6e12,
    "MI250X": 383e12,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "B200": 2250e12,
    "A100": 312e12,
}


def peak_bf16_flops(product: str | None) -> float | None:
    """Dense bf16 peak of a product name like 'AMD Instinct MI300X OAM' or 'NVIDIA H200'."""
    if not product:
        return None
    up = product.upper().replace(" ", "")
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in up:
            return PEAK_BF16_FLOPS[key]
    return None


def parse_mask(value: str | None) -> list[str] | None:
    """A visibility mask as a list of device ids; None when unset, [] when set to empty (no devices)."""
    if value is None:
        return None
    return [p.strip() for p in value.split(",") if p.strip()]


class Platform:
    """What one kind of accelerator needs. Subclass, set the class attributes, register."""

    name: ClassVar[str] = ""  # what RLKUBE_PLATFORM selects
    vendor: ClassVar[Vendor] = "cpu"
    device_name: ClassVar[str] = "cpu"  # torch device type
    visible_devices_var: ClassVar[str | None] = None
    ray_resource_name: ClassVar[str | None] = None  # Ray's resource for one device
    communication_backend: ClassVar[str] = "gloo"
    priority: ClassVar[int] = 0  # probed in descending priority

    def __init__(self, probe: ProbeResult | None = None) -> None:
        self.probe_result = probe or ProbeResult(matched=True, reasons=[f"{self.name} selected"])

    @classmethod
    def probe(cls) -> ProbeResult:
        """Does this machine/process look like this platform? Must not raise."""
        return ProbeResult(matched=False, reasons=["no probe"])

    # -- devices ---------------------------------------------------------------------------
    def device_count(self) -> int:
        """Devices this process can use."""
        return self.probe_result.device_count or 0

    def product_name(self) -> str | None:
        return self.probe_result.product

    def peak_flops(self, dtype: str = "bf16") -> float | None:
        """Dense peak FLOP/s of one device for MFU; None where unknown (and on CPU)."""
        if dtype != "bf16":
            return None
        return peak_bf16_flops(self.product_name())

    def reconcile_visible_devices(self, environ: Mapping[str, str]) -> dict[str, str | None]:
        """Changes to make to `environ` so visibility is unambiguous (None = unset). Pure."""
        return {}

    def apply_visible_devices(self, environ: os._Environ[str] | dict[str, str] | None = None) -> None:
        """Reconcile in place (os.environ by default) before torch initialises its device runtime."""
        target = os.environ if environ is None else environ
        for k, v in self.reconcile_visible_devices(target).items():
            if v is None:
                target.pop(k, None)
            else:
                target[k] = v

    # -- Ray -------------------------------------------------------------------------------
    def ray_noset_env(self) -> dict[str, str]:
        return dict(envtables.RAY_NOSET_ENV[self.vendor])

    def ray_options(self, devices: float) -> dict[str, Any]:
        """Actor options asking Ray for `devices` accelerators of this platform."""
        if self.ray_resource_name == "GPU":
            return {"num_gpus": devices}
        if self.ray_resource_name:
            return {"resources": {self.ray_resource_name: devices}}
        return {}

    def ray_runtime_env(self, engine: Engine = "hf") -> dict[str, Any]:
        """`runtime_env` for ray.init so every worker gets the platform env."""
        return {"env_vars": envtables.ray_container_env(self.vendor, engine)}

    # -- process env -----------------------------------------------------------------------
    def trainer_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        return envtables.trainer_env(self.vendor, os.environ if base is None else base)

    def engine_env(self, engine: Engine, base: Mapping[str, str] | None = None) -> dict[str, str]:
        return envtables.engine_env(self.vendor, engine, os.environ if base is None else base)

    def engine_args(self, engine: Engine) -> dict[str, Any]:
        return envtables.engine_args(self.vendor, engine)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (used by `rlkube doctor`)."""
        return {
            "name": self.name,
            "vendor": self.vendor,
            "device_name": self.device_name,
            "communication_backend": self.communication_backend,
            "ray_resource_name": self.ray_resource_name,
            "visible_devices_var": self.visible_devices_var,
            "product": self.product_name(),
            "peak_bf16_flops": self.peak_flops(),
            "reasons": list(self.probe_result.reasons),
        }


_REGISTRY: dict[str, type[Platform]] = {}
_entry_points_loaded = False


def register_platform(cls: type[Platform]) -> type[Platform]:
    """Class decorator: make `cls` selectable by name and probed by priority."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty `name`")
    _REGISTRY[cls.name] = cls
    return cls


def _load_entry_points() -> None:
    """Third-party platforms: `[project.entry-points."rlkube.platforms"] foo = "pkg.mod:FooPlatform"`."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        obj = ep.load()
        if isinstance(obj, type) and issubclass(obj, Platform) and obj.name not in _REGISTRY:
            register_platform(obj)


def registered_platforms() -> dict[str, type[Platform]]:
    _load_entry_points()
    return dict(_REGISTRY)


@dataclass(frozen=True)
class Detection:
    """The chosen platform plus every probe's verdict (what doctor prints as 'why')."""

    platform: Platform
    probes: dict[str, ProbeResult]
    forced: bool


def detect_platform(environ: Mapping[str, str] | None = None) -> Detection:
    """RLKUBE_PLATFORM if set, else the highest-priority platform whose probe matches."""
    environ = os.environ if environ is None else environ
    reg = registered_platforms()
    forced = environ.get(PLATFORM_ENV_VAR, "").strip().lower()
    if forced:
        if forced not in reg:
            known = sorted(reg)
            raise PlatformError(f"{PLATFORM_ENV_VAR}={forced!r} is not a registered platform; known: {known}")
        cls = reg[forced]
        res = cls.probe()
        reasons = [f"forced by {PLATFORM_ENV_VAR}={forced}", *res.reasons]
        probe = ProbeResult(True, reasons, res.device_count, res.product)
        return Detection(cls(probe), {forced: res}, forced=True)
    probes: dict[str, ProbeResult] = {}
    for cls in sorted(reg.values(), key=lambda c: -c.priority):
        res = cls.probe()
        probes[cls.name] = res
        if res.matched:
            return Detection(cls(res), probes, forced=False)
    raise PlatformError(f"no platform matched: {[(n, p.reasons) for n, p in probes.items()]}")


_current: Platform | None = None


def current_platform() -> Platform:
    """The process's platform, detected once."""
    global _current
    if _current is None:
        _current = detect_platform().platform
    return _current


def reset_current_platform() -> None:
    """Forget the cached detection (tests; after changing RLKUBE_PLATFORM)."""
    global _current
    _current = None


def get_platform(name: str) -> Platform:
    """A platform by registered name, without probing for a match (its probe still fills counts)."""
    reg = registered_platforms()
    if name not in reg:
        raise PlatformError(f"unknown platform {name!r}; known: {sorted(reg)}")
    cls = reg[name]
    res = cls.probe()
    return cls(ProbeResult(True, [f"asked for {name}", *res.reasons], res.device_count, res.product))
