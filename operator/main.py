"""``rlkube-operator``: the Kopf operator process with the flags a Deployment needs.

Wraps :func:`kopf.operator` (not ``kopf run``) so the handler set, metrics server, logging format,
peering and namespaces are decided here in one place, and the chart passes them as plain flags/env.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import kopf
import yaml

from rlkube.api import RenderDefaults

from . import metrics
from .handlers import REGISTRY
from .policy import load_policy
from .reconciler import Config, Reconciler


def _env_list(name: str) -> list[str]:
    return [n for n in os.environ.get(name, "").replace(",", " ").split() if n]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlkube-operator", description="RLJob -> KubeRay operator for AMD GPUs.")
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=None,
        help="watch this namespace (repeat; globs ok). Default: env RLKUBE_NAMESPACES, else all namespaces.",
    )
    p.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (cluster-wide)."
    )
    p.add_argument(
        "--peering", default=os.environ.get("RLKUBE_PEERING"), help="KopfPeering name (HA replicas)."
    )
    p.add_argument(
        "--priority",
        default=os.environ.get("RLKUBE_PRIORITY", "0"),
        help="peering priority (the highest live replica acts), or `auto`: a random one per process, so "
        "replicas of one Deployment never tie (equal priorities pause them all).",
    )
    p.add_argument(
        "--peering-lifetime",
        type=int,
        default=int(os.environ.get("RLKUBE_PEERING_LIFETIME", "15")),
        help="seconds a keep-alive counts: the longest a crashed active replica blocks a standby.",
    )
    p.add_argument(
        "--exclude-namespace",
        action="append",
        default=[],
        help="with --all-namespaces: never serve this namespace (repeat). The watches filter it out.",
    )
    p.add_argument("--standalone", action="store_true", help="no peering at all (one replica, Recreate).")
    p.add_argument(
        "--liveness", default=os.environ.get("RLKUBE_LIVENESS"), help="e.g. http://0.0.0.0:8080/healthz"
    )
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("RLKUBE_METRICS_PORT", "0")))
    p.add_argument("--metrics-addr", default=os.environ.get("RLKUBE_METRICS_ADDR", "0.0.0.0"))
    p.add_argument(
        "--log-format",
        choices=("plain", "full", "json"),
        default=os.environ.get("RLKUBE_LOG_FORMAT", "full"),
    )
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--render-defaults",
        type=Path,
        default=os.environ.get("RLKUBE_RENDER_DEFAULTS") or None,
        help="YAML file of admin-owned runtime defaults fed to the renderer (the chart mounts it).",
    )
    p.add_argument(
        "--policy",
        type=Path,
        default=os.environ.get("RLKUBE_POLICY") or None,
        help="YAML file of the admin policy (what RLJobs may ask for; the chart mounts it). "
        "Default: the chart's default policy.",
    )
    p.add_argument("--status-workers", type=int, default=int(os.environ.get("RLKUBE_STATUS_WORKERS", "4")))
    return p.parse_args(argv)


def load_render_defaults(path: Path | None) -> RenderDefaults | None:
    """The renderer's RenderDefaults from YAML (or None: the renderer's built-in defaults)."""
    if path is None:
        return None
    return RenderDefaults.model_validate(yaml.safe_load(path.read_text()) or {})


def peering_priority(value: str) -> int:
    """An explicit priority, or for ``auto`` a random one in [1, 2**31): two replicas tie with p ~ 5e-10."""
    if value == "auto":
        return random.SystemRandom().randrange(1, 2**31)
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fmt = {"plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL, "json": kopf.LogFormat.JSON}[
        args.log_format
    ]
    kopf.configure(verbose=args.verbose, quiet=args.quiet, log_format=fmt)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if not args.verbose:
        # Kopf logs every watch-event handler run at INFO ("Handler 'pod_event' succeeded"): thousands a
        # minute on a busy cluster. Our own decisions log on rlkube.operator; Kopf's warnings still show.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    namespaces = args.namespace if args.namespace is not None else _env_list("RLKUBE_NAMESPACES")
    clusterwide = args.all_namespaces or not namespaces
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    metrics.set_phase_counts({})

    if args.exclude_namespace and not clusterwide:
        raise SystemExit("--exclude-namespace applies to --all-namespaces only")
    priority = peering_priority(args.priority)
    config = Config(
        render_defaults=load_render_defaults(args.render_defaults),
        policy=load_policy(args.policy),
        exclude_namespaces=tuple(args.exclude_namespace),
        status_workers=args.status_workers,
        # Namespace globs need Kopf to list namespaces; nothing else needs cluster-scoped reads (the
        # CRDs are discovered once at start: install KubeRay before the operator).
        scan_cluster=not clusterwide and any(c in ns for ns in namespaces for c in "*?[!"),
    )
    memo = kopf.Memo(reconciler=Reconciler(config))
    standalone = args.standalone or not args.peering
    settings = kopf.OperatorSettings()
    # The chart grants no cluster-scoped list of namespaces/CRDs: Kopf must not scan for them.
    settings.scanning.disabled = not config.scan_cluster
    if not standalone:
        settings.peering.mandatory = True  # never run un-peered when replicas rely on peering
        settings.peering.lifetime = args.peering_lifetime
        logging.getLogger("rlkube.operator").info(
            "peering %s with priority %d (lifetime %d s)", args.peering, priority, args.peering_lifetime
        )
    try:
        asyncio.run(
            kopf.operator(
                registry=REGISTRY,
                settings=settings,
                memo=memo,
                clusterwide=clusterwide,
                namespaces=[] if clusterwide else namespaces,
                standalone=standalone,
                peering_name=args.peering if not standalone else None,
                priority=priority,
                liveness_endpoint=args.liveness,
            )
        )
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
