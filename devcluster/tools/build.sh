#!/usr/bin/env bash
# Builds (or reuses) the local control plane's binaries from the Go module proxy.
#
# Each component is its own tiny wrapper module here (go.mod/go.sum only; no upstream source is
# committed). Outputs go to $RLKUBE_CACHE/<component>-<version>/bin, keyed by the version read
# from the wrapper's go.mod, so a warm rerun costs seconds. Prints one progress line per
# 50 packages compiled during a cold build. Usage: build.sh [component...]  (default: all)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${RLKUBE_CACHE:-$HOME/.cache/rlkube}
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
export GOCACHE=${GOCACHE:-$cache/go-build}
JOBS=${GO_BUILD_JOBS:-2}

version_of() {  # version_of <dir> <module>
  awk -v m="$2" '$1 == m {print $2; exit} $1 == "require" && $2 == m {print $3; exit}' "$here/$1/go.mod"
}

binary_name() {  # the file go build -o DIR/ writes for a main package (a /vN suffix is dropped)
  case $1 in go.etcd.io/etcd/server/v3) echo etcd ;; *) basename "$1" ;; esac
}

# build <component> <dir> <module> <pkg...>: builds every pkg's main into the component's bin dir.
build() {
  local component=$1 dir=$2 module=$3; shift 3
  local version; version=$(version_of "$dir" "$module")
  [ -n "$version" ] || { echo "[build] cannot read $module version from $dir/go.mod" >&2; exit 1; }
  local out="$cache/$component-$version/bin"
  local missing=0 pkg
  for pkg in "$@"; do [ -x "$out/$(binary_name "$pkg")" ] || missing=1; done
  if [ "$missing" = 0 ]; then
    echo "[build] $component $version: cached in $out"
    return
  fi
  echo "[build] $component $version: cold build (this can take minutes; progress below)"
  local start=$SECONDS ldflags="-s -w" tags=""
  if [ "$component" = kubernetes ]; then
    local minor=${version#v1.}; minor=${minor%%.*}
    ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
    tags="selinux,notest,grpcnotrace"
  elif [ "$component" = helm ]; then
    ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$version"
  fi
  mkdir -p "$out.tmp"
  (cd "$here/$dir" && go build -v -p "$JOBS" -trimpath ${tags:+-tags "$tags"} -ldflags "$ldflags" -o "$out.tmp/" "$@") 2>&1 \
    | awk -v c="$component" '/^#|error|Error|cannot|undefined/ {print; next} {n++; if (n % 50 == 0) {printf "[build] %s: %d packages compiled\n", c, n; fflush()}}'
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "[build] $component failed" >&2; exit 1; }
  [ -f "$out.tmp/server" ] && mv "$out.tmp/server" "$out.tmp/etcd"   # go names etcd's main after .../server/v3
  mkdir -p "$out" && mv "$out.tmp"/* "$out/" && rmdir "$out.tmp"
  echo "[build] $component $version: built in $((SECONDS - start)) s -> $out"
}

crds() {  # KubeRay CRDs come from the same module zip as the operator binary.
  local version; version=$(version_of kuberay github.com/ray-project/kuberay/ray-operator)
  local out="$cache/kuberay-$version/crds"
  if [ ! -f "$out/ray.io_rayjobs.yaml" ]; then
    local dir; dir=$(cd "$here/kuberay" && go mod download -json "github.com/ray-project/kuberay/ray-operator@$version" | python3 -P -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
    mkdir -p "$out" && cp "$dir"/config/crd/bases/ray.io_*.yaml "$out/" && chmod u+w "$out"/*.yaml
  fi
  echo "[build] kuberay CRDs: $out"
}

kwok_stages() {  # kwok alone simulates nothing without Stage configs; take the upstream defaults.
  local version; version=$(version_of kwok sigs.k8s.io/kwok)
  local out="$cache/kwok-$version/stages"
  if [ ! -f "$out/pod-delete.yaml" ]; then
    local dir; dir=$(cd "$here/kwok" && go mod download -json "sigs.k8s.io/kwok@$version" | python3 -P -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
    mkdir -p "$out"
    cp "$dir"/kustomize/stage/node/fast/node-initialize.yaml \
       "$dir"/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
       "$dir"/kustomize/stage/pod/fast/pod-{ready,complete,delete}.yaml "$out/"
    chmod u+w "$out"/*.yaml
  fi
  echo "[build] kwok stages: $out"
}

components=${*:-kubernetes etcd kwok kuberay helm}
for c in $components; do
  case $c in
    kubernetes) build kubernetes kubernetes k8s.io/kubernetes \
                  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
                  k8s.io/kubernetes/cmd/kube-scheduler ;;
    etcd)       build etcd etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 ;;
    kwok)       build kwok kwok sigs.k8s.io/kwok sigs.k8s.io/kwok/cmd/kwok; kwok_stages ;;
    kuberay)    build kuberay kuberay github.com/ray-project/kuberay/ray-operator github.com/ray-project/kuberay/ray-operator; crds ;;
    helm)       build helm helm helm.sh/helm/v4 helm.sh/helm/v4/cmd/helm ;;
    *) echo "unknown component $c" >&2; exit 2 ;;
  esac
done
