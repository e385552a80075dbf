"""The wait helper fails with the state of the object it waited on (no cluster needed)."""

from __future__ import annotations

import pytest

from rlkube.devcluster.testing import wait_for


def test_wait_for_returns_the_first_truthy_value() -> None:
    calls = iter([None, 0, {"ready": True}])
    assert wait_for(lambda: next(calls), timeout=5, interval=0.01) == {"ready": True}


def test_wait_for_timeout_shows_object_yaml_and_last_error() -> None:
    def probe() -> bool:
        raise KeyError("status")

    with pytest.raises(AssertionError) as err:
        wait_for(
            probe,
            timeout=0.2,
            interval=0.05,
            describe=lambda: {"kind": "Pod", "status": {"phase": "Pending"}},
            what="pod Running",
        )
    text = str(err.value)
    assert "pod Running" in text
    assert "KeyError" in text
    assert "phase: Pending" in text
