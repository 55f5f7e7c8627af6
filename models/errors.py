"""One exception root; each subclass carries the line an operator needs: cause and fix."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class VigilError(Exception):
    """An error a person reads: `cause` says what is wrong, `fix` what to do about it."""

    exit_code = 1

    def __init__(self, cause: str, fix: str | None = None) -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(self.line())

    def line(self) -> str:
        return f"{self.cause}; {self.fix}" if self.fix else self.cause


class BadInput(VigilError):
    exit_code = 2


class NotFound(VigilError):
    exit_code = 3


class Refused(VigilError):
    """The store is fine but the request cannot be honoured now (unproven wake, ...)."""

    exit_code = 4


class StoreNotReady(VigilError):
    """Schema not at head, file not a database, state dir owned by someone else."""

    exit_code = 5


class StoreTrouble(StoreNotReady):
    """The store itself failed (models/trouble.py): locked past the wait, full, read-only,
    damaged, unreachable. `kind` names which, `detail` is the driver's own words."""

    def __init__(self, kind: str, detail: str, cause: str, fix: str | None = None) -> None:
        self.kind = kind
        self.detail = detail
        super().__init__(cause, fix)


class BrokenInvariant(Exception):
    """Something a step relies on is not there (a row it just read, a value a step before
    it wrote): a bug, or a store edited by hand. Raised, not asserted, so `python -O`
    keeps the check."""


def present(value: T | None, what: str) -> T:
    """`value`, or BrokenInvariant when it is None (`what`: the message)."""
    if value is None:
        raise BrokenInvariant(what)
    return value


class IllegalTransition(Exception):
    """A step asked for a move the transition table (models/states.py) does not allow: a
    bug in vigil, refused before any SQL runs. Raised, not asserted: `python -O` strips
    asserts, and this check must hold in every build."""


class LostRace(Exception):
    """A guarded UPDATE matched no row: another step moved the row or the fence changed.

    Not a VigilError: it is control flow for workflows, never shown to a person as is.
    """

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
