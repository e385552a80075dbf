"""Environment tables per GPU vendor and rollout engine.

Pure data and functions, importable without torch or any GPU library: the operator renders
pod env from here, the runtime (rlkube.runtime.platform) applies the same values in-process and
the ROCm image's ENV is generated from (and tested equal to) them, so there is one source of
truth for the ROCm decisions. It lives in the shared contract because both halves read it.

`python -m rlkube.runtime.platform --dockerfile-env` prints the image's ENV block.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import ENGINES, VENDORS, Engine, Vendor

__all__ = [
    "BASE_ENV",
    "ENGINES",
    "ENGINE_ARGS",
    "ENGINE_ENV",
    "GPU_RESOURCE_NAMES",
    "RAY_NOSET_ENV",
    "VENDORS",
    "Engine",
    "Vendor",
    "dockerfile_env",
    "engine_args",
    "engine_env",
    "gpu_resource_name",
    "ray_container_env",
    "render_dockerfile_env",
    "trainer_env",
]

GPU_RESOURCE_NAMES: dict[str, str] = {"amd": "amd.com/gpu", "nvidia": "nvidia.com/gpu"}

# Ray must not rewrite visibility masks: the framework manages them per actor.
RAY_NOSET_ENV: dict[str, dict[str, str]] = {
    "nvidia": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"},
    "amd": {
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES": "1",
    },
    "cpu": {},
}

# Set on every Ray container before `ray start`, on the head and on workers, and in trainers.
BASE_ENV: dict[str, dict[str, str]] = {
    "amd": {
        # Keeps visibility for num_gpus=0 actors (e.g. SGLang server actors).
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        # RCCL on MI300X fails FSDP init without it.
        "HSA_NO_SCRATCH_RECLAIM": "1",
        # cuMem-backed NCCL buffers break RCCL/vLLM sleep mode interplay; off like verl.
        "NCCL_CUMEM_ENABLE": "0",
        # RCCL defaults from the ROCm image recipe; override for multi-node fabrics.
        "NCCL_MIN_NCHANNELS": "112",
        "HIP_FORCE_DEV_KERNARG": "1",
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    },
    "nvidia": {
        "NCCL_CUMEM_ENABLE": "0",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    },
    "cpu": {},
}

# Env a rollout engine process gets on top of BASE_ENV. User-set values win (see `engine_env`).
ENGINE_ENV: dict[tuple[str, str], dict[str, str]] = {
    # AITER kernels make vLLM 1.7x-3.7x faster on MI300X/MI325X/MI355X.
    ("amd", "vllm"): {"VLLM_ROCM_USE_AITER": "1", "VLLM_USE_V1": "1"},
    # SGLang attention must be triton on ROCm; AITER off by default (the image recipe's decision,
    # verl's code default is on: set SGLANG_USE_AITER=1 yourself to opt in).
    ("amd", "sglang"): {"SGLANG_ATTENTION_BACKEND": "triton", "SGLANG_USE_AITER": "0"},
    ("nvidia", "vllm"): {"VLLM_USE_V1": "1"},
}

# Engine constructor arguments that are platform decisions rather than user tuning.
ENGINE_ARGS: dict[tuple[str, str], dict[str, Any]] = {
    # Custom all-reduce conflicts with expandable_segments allocators on ROCm: off for both engines.
    ("amd", "vllm"): {"disable_custom_all_reduce": True},
    ("amd", "sglang"): {"disable_custom_all_reduce": True, "attention_backend": "triton"},
}


def gpu_resource_name(vendor: Vendor) -> str:
    """Kubernetes extended resource a pod limits for this vendor's GPUs."""
    if vendor not in GPU_RESOURCE_NAMES:
        known = sorted(GPU_RESOURCE_NAMES)
        raise ValueError(f"vendor {vendor!r} has no GPU resource; expected one of {known}")
    return GPU_RESOURCE_NAMES[vendor]


def _check(vendor: str, engine: str | None = None) -> None:
    if vendor not in VENDORS:
        raise ValueError(f"unknown vendor {vendor!r}; expected one of {list(VENDORS)}")
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"unknown rollout engine {engine!r}; expected one of {list(ENGINES)}")


def ray_container_env(vendor: Vendor, engine: Engine) -> dict[str, str]:
    """Env for every Ray container of a job on `vendor` GPUs rolling out with `engine`.

    Never contains ROCR_VISIBLE_DEVICES: together with HIP/CUDA masks Ray refuses to start.
    """
    _check(vendor, engine)
    env: dict[str, str] = {}
    env.update(RAY_NOSET_ENV.get(vendor, {}))
    env.update(BASE_ENV.get(vendor, {}))
    env.update(ENGINE_ENV.get((vendor, engine), {}))
    return env


def _with_defaults(defaults: Mapping[str, str], base: Mapping[str, str] | None) -> dict[str, str]:
    """`defaults` under `base`: a value the user already set is never overridden."""
    base = base or {}
    return {k: base.get(k, v) for k, v in defaults.items()}


def trainer_env(vendor: Vendor, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Env a trainer process needs (RCCL/NCCL decisions); user-set values in `base` win."""
    _check(vendor)
    return _with_defaults({**RAY_NOSET_ENV[vendor], **BASE_ENV[vendor]}, base)


def engine_env(vendor: Vendor, engine: Engine, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Env a rollout engine process needs; user-set values in `base` win (SGLANG_USE_AITER=1 opts in)."""
    _check(vendor, engine)
    return _with_defaults(ray_container_env(vendor, engine), base)


def engine_args(vendor: Vendor, engine: Engine) -> dict[str, Any]:
    """Engine constructor arguments that the platform decides (e.g. custom all-reduce off on ROCm)."""
    _check(vendor, engine)
    return dict(ENGINE_ARGS.get((vendor, engine), {}))


def dockerfile_env() -> dict[str, str]:
    """The runtime ENV defaults of Dockerfile.rocm: ROCm base env plus both engines' env.

    The arch variables (PYTORCH_ROCM_ARCH...) follow the GPU_ARCH build arg and are not listed here.
    """
    env: dict[str, str] = {}
    for engine in ("vllm", "sglang"):
        env.update(ray_container_env("amd", engine))
    return env


def render_dockerfile_env(env: Mapping[str, str] | None = None) -> str:
    """One Dockerfile `ENV` instruction, sorted, one variable per line."""
    items = sorted((env if env is not None else dockerfile_env()).items())
    lines = [f'    {k}="{v}"' for k, v in items]
    return "ENV " + " \\\n".join(lines).lstrip() + "\n"
