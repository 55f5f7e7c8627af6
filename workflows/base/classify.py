"""THE step classifier: every path that might record a build failure
asks `classify` first. Only a failure of the build itself counts against the build."""

from __future__ import annotations

import enum

from workflows.base.ports import SpawnError


class StepEnd(str, enum.Enum):
    failed = "failed"  # the build's own fault: spawn error, failed health, exit during settle
    cancelled = "cancelled"  # the attempt's lifecycle ended it: a stop, the agent's shutdown
    stale = "stale"  # the gate refused: superseded, lease lost, not published, digest mismatch


class Stale(Exception):
    """The attempt gate refused; nothing of this step's build ran because of it."""


class Interrupted(Stale):
    """A new driver found the attempt mid-way before its switch (the agent restarted): it is
    abandoned like any stale attempt, then written again (workflows/deploys/request.py resume_in)."""


class Cancelled(Exception):
    """A stop or the agent's shutdown ended the attempt."""


class BuildFailed(Exception):
    """The build itself failed: it did not start, answer its health check, or stay up."""


def classify(exc: BaseException) -> StepEnd:
    if isinstance(exc, Cancelled):
        return StepEnd.cancelled
    if isinstance(exc, Stale):
        return StepEnd.stale
    if isinstance(exc, SpawnError):
        # The box refusing a start (cgroup, log file) is not the build's failure.
        return StepEnd.failed if exc.build_fault else StepEnd.stale
    if isinstance(exc, BuildFailed):
        return StepEnd.failed
    return StepEnd.stale  # anything unexpected: abandon, never blame the build
