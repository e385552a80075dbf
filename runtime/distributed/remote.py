"""The one Ray forwarder for the rollout interface: an engine in its own actor, used as if local.

:class:`EngineHost` is the actor: it builds one engine (``start``) and answers ``call(method, *args)`` for the
methods of :class:`~rlkube.runtime.rollout.base.RolloutEngine` (and nothing else).
:class:`RemoteEngine` is the caller's side: every interface method is forwarded by name, blocking
(``engine.poll()``) or not (``engine.start("poll")`` returns a Ray ref, :meth:`RemoteEngine.wait`
collects it). Neither repeats the interface: both take its method names from the protocol, so a
method added to ``RolloutEngine`` is forwarded without touching this file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rlkube.runtime.rollout.base import RolloutEngine

# The interface's methods and properties, read off the protocol.
ENGINE_PROPERTIES = frozenset(
    n for n, v in vars(RolloutEngine).items() if not n.startswith("_") and isinstance(v, property)
)
ENGINE_METHODS = frozenset(
    n
    for n, v in vars(RolloutEngine).items()
    if not n.startswith("_") and callable(v) and n not in ENGINE_PROPERTIES
)


class EngineFailed(RuntimeError):
    """A rollout engine died or raised; the message names it."""


def _plain(result: Any) -> Any:
    """Generators and sets travel as lists (Ray pickles the value, not a live iterator)."""
    if isinstance(result, (set, frozenset, tuple)) or hasattr(result, "__next__"):
        return list(result)
    return result


class EngineHost:
    """One rollout engine in a Ray actor (``ray.remote(EngineHost)``)."""

    def __init__(self, name: str, build: Callable[[], Any]) -> None:
        self.name = name
        self._build = build
        self.engine: Any = None

    def start(self) -> None:
        """Build the engine. A method, not the constructor: Ray keeps the exception of a failed
        method (a UserError stays one, and ``rlkube-train`` prints it as one line) but only the
        text of a failed constructor."""
        from rlkube.runtime.distributed.groups import local_device

        local_device()  # the platform's visibility rules, before the engine initialises a device
        self.engine = self._build()

    def call(self, method: str, *args: Any) -> Any:
        if method not in ENGINE_METHODS:
            raise AttributeError(f"{method!r} is not a rollout-interface method")
        return _plain(getattr(self.engine, method)(*args))

    def get(self, prop: str) -> Any:
        if prop not in ENGINE_PROPERTIES:
            raise AttributeError(f"{prop!r} is not a rollout-interface property")
        return getattr(self.engine, prop)

    def where(self) -> dict[str, Any]:
        """Name, pid, node and accelerator ids (for placement checks and error messages)."""
        from rlkube.runtime.distributed.groups import where_am_i

        return where_am_i(name=self.name)


class RemoteEngine:
    """The rollout interface over an :class:`EngineHost` actor handle."""

    def __init__(self, handle: Any, name: str, timeout_s: float = 3600.0) -> None:
        self.handle = handle
        self.name = name
        self.timeout_s = timeout_s
        self._props: dict[str, Any] = {}

    def start(self, method: str, *args: Any) -> Any:
        """Call ``method`` without waiting; :meth:`wait` on the returned ref."""
        if method not in ENGINE_METHODS:
            raise AttributeError(f"{method!r} is not a rollout-interface method")
        return self.handle.call.remote(method, *args)

    def wait(self, ref: Any) -> Any:
        """The result of a started call; a dead or failing engine raises :class:`EngineFailed`."""
        import ray

        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayActorError as e:
            raise EngineFailed(f"rollout engine {self.name} died: {_last_line(e)}") from e
        except ray.exceptions.RayTaskError as e:
            raise EngineFailed(f"rollout engine {self.name} failed: {_last_line(e)}") from e

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method in ENGINE_PROPERTIES:
            if method not in self._props or method == "policy_version":
                value = self.wait(self.handle.get.remote(method))
                if method == "capabilities":  # a copy from another process is never direct
                    value = dataclasses.replace(value, direct_weights=False)
                self._props[method] = value
            return self._props[method]
        if method not in ENGINE_METHODS:
            raise AttributeError(method)
        return lambda *args: self.wait(self.start(method, *args))

    def __repr__(self) -> str:
        return f"RemoteEngine({self.name})"


def _last_line(e: BaseException) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else type(e).__name__
