"""Child names that stay within Kubernetes and KubeRay limits, deterministically."""

from __future__ import annotations

import hashlib
import re

# KubeRay refuses RayJob names over 47 characters (it appends "-xxxxx" for the RayCluster, which
# must stay within 53) and names that are not DNS-1035 labels (must start with a letter).
MAX_RAYJOB_NAME = 47
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


DIGEST_HEX = 16
# What a hashed name ends with. A literal name of this shape is hashed too, so the mapping is one-to-one:
# no RLJob can be named after another one's hashed RayJob and take it over (issue 12).
_HASHED = re.compile(rf"-[0-9a-f]{{{DIGEST_HEX}}}$")


def _digest(name: str) -> str:
    """64 bits of sha256: a second name with the same suffix would take ~2^64 tries to find."""
    return hashlib.sha256(name.encode()).hexdigest()[:DIGEST_HEX]


def ray_job_name(rljob: str) -> str:
    """The RayJob name for an RLJob: the same name when KubeRay accepts it, else a hashed short form.

    The hashed form keeps a readable prefix and is stable across operator restarts, so a
    re-render never creates a second RayJob. Names are one-to-one: a kept name never ends like a
    hashed one (a name that does is hashed as well).
    """
    if len(rljob) <= MAX_RAYJOB_NAME and _DNS1035.match(rljob) and not _HASHED.search(rljob):
        return rljob
    clean = re.sub(r"[^a-z0-9-]+", "-", rljob.lower())
    if not clean[:1].isalpha():
        clean = "r-" + clean
    suffix = _digest(rljob)
    prefix = clean[: MAX_RAYJOB_NAME - len(suffix) - 1].strip("-")
    return f"{prefix}-{suffix}" if prefix else f"r-{suffix}"


def child_name(rljob: str, suffix: str) -> str:
    """`<rljob>-<suffix>` for ConfigMap/ServiceAccount/Role names (RLJob names are at most 63 chars)."""
    return f"{rljob}-{suffix}"
