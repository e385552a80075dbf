"""`rlkube-devcluster up|down|status|env`: the shell face of DevCluster (used by `make cluster-up`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from .cluster import ClusterConfig, DevCluster
from .errors import DevClusterError
from .nodes import node_manifests


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlkube-devcluster", description=__doc__)
    p.add_argument(
        "--state-dir", type=Path, default=None, help="default: $RLKUBE_DEVCLUSTER_DIR or .devcluster"
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the cluster (no-op if it already runs)")
    nodes = sub.add_parser("nodes-yaml", help="print the fake nodes as YAML (to add them to kind + kwok)")
    for cmd in (up, nodes):
        cmd.add_argument("--nodes", type=int, default=4, help="fake GPU nodes (half MI300X, half MI355X)")
        cmd.add_argument("--gpus-per-node", type=int, default=8, help="allocatable amd.com/gpu per GPU node")
        cmd.add_argument("--cpu-nodes", type=int, default=1, help="CPU-only nodes (for Ray heads)")
        cmd.add_argument(
            "--gpu-taint", action="store_true", help="taint GPU nodes amd.com/gpu=present:NoSchedule"
        )
    up.add_argument("--no-kuberay", action="store_true", help="skip the KubeRay CRDs and operator")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for all-Ready")
    up.add_argument(
        "--real-node",
        choices=("auto", "on", "off"),
        default=None,
        help="one real CPU node beside the fake ones: auto (when the machine allows it), on (required), "
        "off. Default: $RLKUBE_REAL_NODE (0/1/auto), else auto",
    )
    sub.add_parser("down", help="stop exactly the processes `up` started and remove the state")
    sub.add_parser("status", help="print the state as JSON; exit 1 if not running")
    sub.add_parser("env", help="print `export KUBECONFIG=...` for eval")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "nodes-yaml":
        items = node_manifests(args.nodes, args.gpus_per_node, args.cpu_nodes, args.gpu_taint)
        print(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}, sort_keys=False), end="")
        return 0
    if args.cmd == "up":
        config = ClusterConfig(
            gpu_nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            cpu_nodes=args.cpu_nodes,
            gpu_taint=args.gpu_taint,
            kuberay=not args.no_kuberay,
            real_node=args.real_node,
            timeout_s=args.timeout,
        )
    else:
        config = None
    cluster = DevCluster(args.state_dir, config)
    try:
        if args.cmd == "up":
            start = time.monotonic()
            was_running = cluster.healthy()
            state = cluster.up(owner="cli")
            took = time.monotonic() - start
            verb = "already running" if was_running else f"all nodes Ready in {took:.1f} s"
            print(f"[devcluster] {verb}: {state['server']} ({len(state['components'])} components)")
            print(f"[devcluster] logs: {cluster.logs_dir}")
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.cmd == "down":
            stopped = cluster.down()
            print(f"[devcluster] stopped {', '.join(stopped) or 'nothing (not running)'}; ports closed")
        elif args.cmd == "status":
            status = cluster.status()
            print(json.dumps(status, indent=2))
            return 0 if status["running"] else 1
        elif args.cmd == "env":
            if not cluster.healthy():
                print("[devcluster] not running: make cluster-up", file=sys.stderr)
                return 1
            print(f"export KUBECONFIG={cluster.kubeconfig}")
    except DevClusterError as err:
        print(f"[devcluster] error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
