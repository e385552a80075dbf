"""Dockerfile.rocm's contract, checked by parsing it (no Docker engine here): its env is the
platform layer's ROCm env, and the recipe keeps the decisions docs/image.md promises."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from rlkube.api import platform_env as env

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile.rocm"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, backslash continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def parse_kv(args: str) -> dict[str, str]:
    """`K=V K2="v 2"` (the ENV / ARG form)."""
    kv = {}
    for tok in shlex.split(args):
        k, _, v = tok.partition("=")
        kv[k] = v
    return kv


INS = instructions(DOCKERFILE.read_text())


def of(kind: str) -> list[str]:
    return [a for k, a in INS if k == kind]


def test_image_env_is_exactly_the_platform_layers_rocm_env() -> None:
    text = DOCKERFILE.read_text()
    block = re.search(r"# BEGIN rlkube platform env[^\n]*\n(.*?)# END rlkube platform env", text, re.S)
    assert block is not None, "generated ENV block markers missing"
    assert block.group(1) == env.render_dockerfile_env(), (
        "regenerate: python -m rlkube.runtime.platform --dockerfile-env"
    )
    image_env: dict[str, str] = {}
    for args in of("ENV"):
        image_env.update(parse_kv(args))
    rocm = env.dockerfile_env()
    assert {k: image_env[k] for k in rocm} == rocm
    assert image_env["SGLANG_USE_AITER"] == "0" and image_env["SGLANG_ATTENTION_BACKEND"] == "triton"
    assert image_env["VLLM_ROCM_USE_AITER"] == "1" and image_env["HSA_NO_SCRATCH_RECLAIM"] == "1"
    assert "ROCR_VISIBLE_DEVICES" not in image_env
    assert image_env["PYTORCH_ROCM_ARCH"] == "${GPU_ARCH}"


def test_build_args_and_pins() -> None:
    args = {}
    for a in of("ARG"):
        args.update(parse_kv(a))
    assert args["BASE_IMAGE"] == "rocm/primus:v26.7"
    assert of("FROM") == ["${BASE_IMAGE}"]
    assert args["GPU_ARCH"] == "gfx942;gfx950" and args["MAX_JOBS"].isdigit()
    assert args["VLLM_TAG"] == "v0.27.0" and args["SGLANG_TAG"]
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["runtime"]
    assert f"ray=={args['RAY_VERSION']}" in pins, "image Ray must equal the runtime's pinned Ray"


def test_recipe_builds_engines_without_replacing_torch_and_fixes_gpu_discovery() -> None:
    runs = " ".join(of("RUN"))
    assert "VLLM_TARGET_DEVICE=rocm" in runs and "vllm-project/vllm" in runs
    assert "pip install --no-deps -c /opt/constraints.txt ." in runs  # SGLang beside vLLM
    assert "setup_rocm.py" in runs  # sgl-kernel for ROCm
    assert runs.count("torch was replaced") >= 3  # checked after vLLM, SGLang and rlkube
    assert "amd_smi" in runs and "import amdsmi" in runs
    assert "sed -i 's/RTLD_GLOBAL/RTLD_LOCAL/g'" in runs
    assert '"ray[default]==${RAY_VERSION}"' in runs
    assert "/opt/rlkube[runtime]" in runs


def test_runs_as_non_root_with_doctor_as_healthcheck() -> None:
    users = of("USER")
    assert users and users[-1] not in ("root", "0")
    last_user = max(i for i, (k, _) in enumerate(INS) if k == "USER")
    assert all(k != "RUN" for k, _ in INS[last_user:]), "nothing may run as root after USER"
    (hc,) = of("HEALTHCHECK")
    assert hc.split("CMD", 1)[1].strip() == '["rlkube", "doctor"]'
