"""Platform layer: what differs between ROCm, CUDA and CPU, in one place.

`rlkube.api.platform_env` holds the pure env tables (no torch import) that the operator
renders into pod specs; the registry here probes the process and answers devices, visibility,
Ray, process env, communication backend and peak FLOP/s.

    from rlkube.runtime.platform import current_platform
    p = current_platform()          # RLKUBE_PLATFORM=amd|nvidia|cpu or probing
    p.apply_visible_devices()       # before torch touches the GPU
    os.environ.update(p.engine_env("vllm"))

Importing this package does not import torch; probing does, lazily.
"""

from rlkube.runtime.platform.base import (
    ENTRY_POINT_GROUP,
    PLATFORM_ENV_VAR,
    Detection,
    Platform,
    PlatformError,
    ProbeResult,
    VisibilityError,
    current_platform,
    detect_platform,
    get_platform,
    parse_mask,
    peak_bf16_flops,
    register_platform,
    registered_platforms,
    reset_current_platform,
)
from rlkube.runtime.platform.platforms import CpuPlatform, CudaPlatform, RocmPlatform

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLATFORM_ENV_VAR",
    "CpuPlatform",
    "CudaPlatform",
    "Detection",
    "Platform",
    "PlatformError",
    "ProbeResult",
    "RocmPlatform",
    "VisibilityError",
    "current_platform",
    "detect_platform",
    "get_platform",
    "parse_mask",
    "peak_bf16_flops",
    "register_platform",
    "registered_platforms",
    "reset_current_platform",
]
