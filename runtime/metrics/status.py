"""Push training progress to the RLJob's ``status.progress`` through the status subresource.

In a pod the per-RLJob ServiceAccount may only patch this RLJob's status; the pusher uses the
in-cluster token (or ``KUBECONFIG`` / ``RLKUBE_KUBECONFIG`` on a laptop and in the demo). A push is a
JSON merge patch of ``status.progress`` alone, so it never clobbers the operator's phase or
conditions. Failures are logged and never fatal; pushes are rate-limited (``min_interval_s``) except
the final one.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from rlkube.api import GROUP, PLURAL, VERSION, Progress, step_display
from rlkube.api.contract import ENV_RLJOB_NAME, ENV_RLJOB_NAMESPACE, now_rfc3339

log = logging.getLogger(__name__)


# Metrics copied into status.progress.metrics (as e.g. staleness_dropped_groups_total): the headline
# extras plus every count of work thrown away, so `kubectl get rljob -o yaml` shows what was dropped.
PROGRESS_EXTRAS = (
    "eval/reward_mean",
    "reward/accuracy",
    "perf/mfu",
    "timing_s/update_weights",
    "staleness/max",
    "staleness/stale_fraction",
    "staleness/dropped_groups_total",
    "dynamic_sampling/dropped_groups_total",
    "reward/nonfinite_total",
    "data/prompts_drawn",
    "data/prompts_too_long_total",
)


def progress_from_metrics(
    step: int, total: int, m: dict[str, float], last_ckpt: int | None = None
) -> Progress:
    """The ``status.progress`` object for a step's metrics."""

    def g(k: str) -> float | None:
        v = m.get(k)
        return None if v is None else float(v)

    extra = {k.replace("/", "_"): float(v) for k, v in m.items() if k in PROGRESS_EXTRAS}
    return Progress(
        step=step,
        total_steps=total,
        step_display=step_display(step, total),
        policy_version=int(m["policy_version"]) if "policy_version" in m else None,
        reward_mean=g("reward/mean"),
        reward_std=g("reward/std"),
        response_length_mean=g("response_length/mean"),
        staleness_mean=g("staleness/mean"),
        tokens_per_second=g("perf/tokens_per_s"),
        step_seconds=g("timing_s/step"),
        last_checkpoint_step=last_ckpt,
        last_update_time=now_rfc3339(),
        metrics=extra,
    )


class StatusPusher:
    """Rate-limited, failure-tolerant merge patches of ``status.progress``."""

    def __init__(
        self,
        name: str | None = None,
        namespace: str | None = None,
        *,
        min_interval_s: float = 5.0,
        api: Any = None,
    ) -> None:
        self.name = name if name is not None else os.environ.get(ENV_RLJOB_NAME)
        if namespace is None:
            namespace = os.environ.get(ENV_RLJOB_NAMESPACE, "default")
        self.namespace = namespace
        self.min_interval_s = min_interval_s
        self._api = api
        self._last = float("-inf")  # the first push is never rate-limited (monotonic may start near 0)
        self.pushed = 0
        self.failures = 0
        self._warned = False

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def _client(self) -> Any:
        if self._api is None:
            from kubernetes import client, config

            kubeconfig = os.environ.get("RLKUBE_KUBECONFIG") or os.environ.get("KUBECONFIG")
            if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("RLKUBE_KUBECONFIG"):
                config.load_incluster_config()
            else:
                config.load_kube_config(config_file=kubeconfig)
            self._api = client.CustomObjectsApi()
        return self._api

    def push(self, progress: Progress, *, force: bool = False) -> bool:
        """Patch now unless rate-limited; True when the API server accepted it."""
        if not self.enabled:
            return False
        now = time.monotonic()
        if not force and now - self._last < self.min_interval_s:
            return False
        self._last = now
        body = {"status": {"progress": progress.model_dump(by_alias=True, exclude_none=True, mode="json")}}
        try:
            self._client().patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                self.name,
                body,
                _content_type="application/merge-patch+json",
            )
        except Exception as e:  # progress is a view; training must go on
            self.failures += 1
            if not self._warned or self.failures % 20 == 0:
                log.warning(
                    "status push to rljob %s/%s failed (%d so far): %s",
                    self.namespace,
                    self.name,
                    self.failures,
                    e,
                )
                self._warned = True
            return False
        self.pushed += 1
        if self.pushed == 1:  # one line, so a pod's log shows where its progress goes
            log.info(
                "status.progress of rljob %s/%s pushed (step %s)", self.namespace, self.name, progress.step
            )
        return True
