"""Environment tables per GPU vendor and rollout engine.

Pure data and functions, importable without torch or any GPU library: the operator renders
pod env from here and the runtime applies the same values in-process, so there is one source
of truth for the ROCm decisions.
"""

from __future__ import annotations

from typing import Literal

Vendor = Literal["amd", "nvidia", "cpu"]
Engine = Literal["vllm", "sglang", "hf"]

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

# Set on every Ray container before `ray start`, on the head and on workers.
BASE_ENV: dict[str, dict[str, str]] = {
    "amd": {
        # Keeps visibility for num_gpus=0 actors (e.g. SGLang server actors).
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        # RCCL on MI300X fails FSDP init without it.
        "HSA_NO_SCRATCH_RECLAIM": "1",
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

ENGINE_ENV: dict[tuple[str, str], dict[str, str]] = {
    ("amd", "vllm"): {"VLLM_ROCM_USE_AITER": "1", "VLLM_USE_V1": "1"},
    # SGLang attention must be triton on ROCm; AITER off by default (image recipe's decision).
    ("amd", "sglang"): {"SGLANG_ATTENTION_BACKEND": "triton", "SGLANG_USE_AITER": "0"},
    ("nvidia", "vllm"): {"VLLM_USE_V1": "1"},
}


def gpu_resource_name(vendor: Vendor) -> str:
    """Kubernetes extended resource a pod limits for this vendor's GPUs."""
    if vendor not in GPU_RESOURCE_NAMES:
        raise ValueError(f"vendor {vendor!r} has no GPU resource; expected one of {sorted(GPU_RESOURCE_NAMES)}")
    return GPU_RESOURCE_NAMES[vendor]


def ray_container_env(vendor: Vendor, engine: Engine) -> dict[str, str]:
    """Env for every Ray container of a job on `vendor` GPUs rolling out with `engine`.

    Never contains ROCR_VISIBLE_DEVICES: together with HIP/CUDA masks Ray refuses to start.
    """
    env: dict[str, str] = {}
    env.update(RAY_NOSET_ENV.get(vendor, {}))
    env.update(BASE_ENV.get(vendor, {}))
    env.update(ENGINE_ENV.get((vendor, engine), {}))
    return env
