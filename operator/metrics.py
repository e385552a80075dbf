"""Prometheus metrics, named in KubeRay's style (``kuberay_job_info`` -> ``rlkube_rljob_info``).

Kopf has no metrics of its own; these count what users and the benchmark ask about: reconciles, errors,
their durations, RLJobs by phase, time from creation to Running, and every API request this process makes.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from rlkube.api.contract import PHASES

RECONCILES = Counter("rlkube_reconcile_total", "Reconciles run, by kind (spec | status).", ["kind"])
RECONCILE_ERRORS = Counter("rlkube_reconcile_errors_total", "Reconciles that raised, by kind.", ["kind"])
RECONCILE_DURATION = Histogram(
    "rlkube_reconcile_duration_seconds",
    "Wall time of one reconcile, by kind.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RLJOBS = Gauge("rlkube_rljobs", "RLJobs known to this operator, by phase.", ["phase"])
TIME_TO_RUNNING = Histogram(
    "rlkube_time_to_running_seconds",
    "Seconds from RLJob creation to its first Running phase.",
    buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
RLJOB_INFO = Gauge(
    "rlkube_rljob_info",
    "One series per RLJob (value 1) carrying its algorithm, mode and phase.",
    ["namespace", "name", "algorithm", "mode", "phase"],
)
API_REQUESTS = Counter(
    "rlkube_api_requests_total",
    "Kubernetes API requests made by this process (Kopf's and the operator's), by verb, resource, code.",
    ["verb", "resource", "code"],
)


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose ``/metrics`` (plus the default process metrics) on a background thread."""
    start_http_server(port, addr=addr, registry=REGISTRY)


def set_phase_counts(counts: dict[str, int]) -> None:
    for phase in PHASES:
        RLJOBS.labels(phase).set(counts.get(phase, 0))


CHILD_PROBLEMS = Counter(
    "rlkube_child_problems_total",
    "Spec reconciles that wrote no children, by reason: ChildConflict (an object under a child's name is "
    "not this RLJob's) or the API server's refusal of a child (QuotaExceeded, AdmissionRefused, ...).",
    ["reason"],
)
