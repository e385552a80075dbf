"""`python -m rlkube.runtime.platform`: print Dockerfile.rocm's generated ENV block or one env table."""

from __future__ import annotations

import argparse
import sys

from rlkube.api.platform_env import ENGINES, VENDORS, ray_container_env, render_dockerfile_env


def main(argv: list[str] | None = None) -> int:
    """CLI: print the image's ENV block or one vendor/engine table."""
    p = argparse.ArgumentParser(prog="python -m rlkube.runtime.platform")
    p.add_argument("--dockerfile-env", action="store_true", help="print Dockerfile.rocm's ENV block")
    p.add_argument("--vendor", choices=VENDORS, default="amd")
    p.add_argument("--engine", choices=ENGINES, default="vllm")
    a = p.parse_args(argv)
    if a.dockerfile_env:
        sys.stdout.write(render_dockerfile_env())
    else:
        for k, v in sorted(ray_container_env(a.vendor, a.engine).items()):
            sys.stdout.write(f"{k}={v}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
