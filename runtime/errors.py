"""Errors that are the user's to fix (a spec field, a file, their reward function), not rlkube bugs.

``rlkube-train`` prints a :class:`UserError` as one line (exit code 2, the traceback only with
``--debug``); everything else is a crash and keeps its traceback. Raise it with a message that
names the field or file and says what to do.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the RLJob, its files or its code, stated so the user can fix it."""


class NonFiniteRewardError(UserError):
    """The reward function returned NaN or inf for a sample (``data.nonFiniteReward: error``)."""


def find_user_error(exc: BaseException | None) -> UserError | None:
    """The UserError behind ``exc``: itself, a cause/context, or the cause a Ray task error wraps."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        remote = getattr(exc, "cause", None)  # Ray task/actor errors keep the remote exception here
        if isinstance(remote, BaseException):
            exc = remote
            continue
        if isinstance(exc, UserError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None
