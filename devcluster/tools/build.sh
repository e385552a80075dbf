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
  case $1 in go.etcd.io/etcd/server/v3) echo etcd ;; rlkube.io/devcluster/coredns) echo coredns ;; *) basename "$1" ;; esac
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
  if [ "$component" = kubernetes ] || [ "$component" = kubernetes-node ]; then
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

pause() {  # the pod sandbox's pause program, from pause.c in the same kubernetes module zip, static
  local version; version=$(version_of kubernetes k8s.io/kubernetes)
  local out="$cache/pause-$version/bin"
  if [ ! -x "$out/pause" ]; then
    command -v gcc >/dev/null || { echo "[build] pause needs gcc (apt-get install gcc libc6-dev)" >&2; exit 1; }
    local dir; dir=$(cd "$here/kubernetes" && go mod download -json "k8s.io/kubernetes@$version" | python3 -P -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
    mkdir -p "$out"
    gcc -Os -Wall -Werror -static -DVERSION="$version-rlkube" -o "$out/pause.tmp" "$dir/build/pause/linux/pause.c"
    strip "$out/pause.tmp" && mv "$out/pause.tmp" "$out/pause"
  fi
  echo "[build] pause: $out/pause"
}

packages() {  # Debian packages of the real node and the image builder, installed when missing (root)
  local want="containerd runc containernetworking-plugins iptables conntrack debootstrap socat ebtables gcc libc6-dev"
  local missing="" p
  for p in $want; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -z "$missing" ]; then echo "[build] node packages: installed"; return; fi
  if [ "$(id -u)" != 0 ]; then
    echo "[build] node packages missing:$missing (not root, so the cluster will be kwok-only)"
    return
  fi
  echo "[build] apt-get install$missing"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
  echo "[build] node packages: installed"
}

# The control plane (kubernetes etcd kwok kuberay helm) is the default; the real node's (packages = its Debian
# packages, kubernetes-node = kubelet + kube-proxy, coredns, pause) by `build.sh node` or by name.
components=${*:-kubernetes etcd kwok kuberay helm}
[ "$components" = node ] && components="packages kubernetes-node coredns pause"
for c in $components; do
  case $c in
    kubernetes) build kubernetes kubernetes k8s.io/kubernetes \
                  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
                  k8s.io/kubernetes/cmd/kube-scheduler ;;
    kubernetes-node) build kubernetes-node kubernetes k8s.io/kubernetes \
                  k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy ;;
    coredns)    build coredns coredns github.com/coredns/coredns rlkube.io/devcluster/coredns ;;
    pause)      pause ;;
    packages)   packages ;;
    etcd)       build etcd etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 ;;
    kwok)       build kwok kwok sigs.k8s.io/kwok sigs.k8s.io/kwok/cmd/kwok; kwok_stages ;;
    kuberay)    build kuberay kuberay github.com/ray-project/kuberay/ray-operator github.com/ray-project/kuberay/ray-operator; crds ;;
    helm)       build helm helm helm.sh/helm/v4 helm.sh/helm/v4/cmd/helm ;;
    *) echo "unknown component $c" >&2; exit 2 ;;
  esac
done
