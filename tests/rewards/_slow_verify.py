"""A verify function for the pool tests: hangs on "hang", says "two" equals "2". Must be importable
by module name so spawned workers can unpickle it."""

from __future__ import annotations

import time


def slow_verify(pred: str, truth: str) -> bool:
    if pred == "hang":
        time.sleep(120)
    if pred == "die":
        import os

        os._exit(3)
    return (pred, truth) == ("two", "2")
