"""Whether the agent may still act on its store: the files it opened are the ones at their
paths, the schema is the one it knows; otherwise the store watch halts it (it then only
says so, and writes nothing). And the one guard of the agent's loops: an error that is the
store's own failure is said by the watch, any other with its traceback."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from sqlalchemy.exc import DBAPIError

from models.errors import StoreNotReady, StoreTrouble
from models.schema import require_head
from models.store import Store
from runners.base.storewatch import FileGuard, StoreWatch, write_back

SCHEMA_EVERY = 2.0  # seconds between checks that the schema is still the one it knows

Trouble = Callable[[BaseException], bool]  # True: the store's own failure, said by the watch


@contextmanager
def guarded(trouble: Trouble, logger: logging.Logger | None = None, what: str = "",
            *args: object) -> Iterator[None]:
    """The one guard of the agent's loops and jobs (each sweep, round, renewal, probe,
    scheduled run): an exception out of the step is either the store's own failure, which
    `trouble` has the store watch say (once, then at a slow cadence; never a traceback) and
    which ends here, or the step's: logged here with its traceback as `what` (the loop goes
    on; the next turn retries), or without a `logger` raised on to the caller."""
    try:
        yield
    except Exception as exc:
        if not trouble(exc):
            if logger is None:
                raise
            logger.exception(what, *args)


class StoreTrust:
    """Whether the agent may still act on its store, and whether an error is the store's
    (runners/agent/daemon.py builds it once the state dir is locked, before recovery)."""

    def __init__(self, store: Store, watch: StoreWatch) -> None:
        self.store = store
        self.watch = watch
        self.files = FileGuard.of(store)  # the files it has open now, at their paths
        self._schema_checked = 0.0

    def guarded(self, logger: logging.Logger, what: str, *args: object) -> AbstractContextManager[None]:
        return guarded(self.trouble, logger, what, *args)

    def trouble(self, exc: BaseException) -> bool:
        """True when `exc` is the store's own failure (said by the watch) or a statement
        the store refused because the schema changed under the agent (which halts it);
        False for any other error, which the caller says itself."""
        if self.watch.trouble(exc):
            return True
        if isinstance(exc, DBAPIError):  # "no such table": is the schema the one it knows?
            self.check_schema(now=True)
            return not self.watch.acting
        return False

    def may_act(self) -> bool:
        """False once the store cannot be trusted: the files this agent opened are no longer
        the ones at their paths (checked at every round: two stat calls), or the watch
        halted (schema changed, store damaged)."""
        if self.watch.acting and self.files is not None:
            changed = self.files.changed()
            if changed is not None:
                self._files_replaced(self.files, changed)
        return self.watch.acting

    def _files_replaced(self, files: FileGuard, which: str) -> None:
        db, pid = files.db, os.getpid()
        restart = f"restart the agent (`kill {pid}`, then start it again)"
        if which == "wal":
            saved = write_back(self.store)
            cause = (f"{db.name}-wal was deleted or replaced while the agent ran (its last "
                     "commits were only in the file it still held open)")
            fix = (f"they are written back to {db} now; {restart}" if saved else
                   f"stop the agent with SIGTERM (`kill {pid}`, never kill -9): as it closes "
                   f"the database it writes them back to {db}; then start it again")
        else:
            cause = f"{db} was deleted or replaced while the agent ran (it still has the old file open)"
            fix = f"{restart}: it then uses the file at that path"
        self.watch.halt("replaced", cause, fix)

    def check_schema(self, now: bool = False) -> None:
        """The schema is still the one this agent knows (a downgrade or an upgrade by a newer
        vigil under it halts it). At most every SCHEMA_EVERY seconds (a small read), and at
        once (`now`) when a statement was refused."""
        if not self.watch.acting:
            return
        if not now and time.monotonic() - self._schema_checked < SCHEMA_EVERY:
            return
        self._schema_checked = time.monotonic()
        try:
            require_head(self.store.engine)
        except StoreTrouble as exc:
            self.watch.trouble(exc)
        except StoreNotReady as exc:
            self.watch.halt("schema", f"the schema changed under the running agent: {exc.cause}",
                            "run `vigil db upgrade`, then restart the agent "
                            f"(`kill {os.getpid()}`, then start it again)")
