"""Whether the agent may still act on its store: the files it opened are the ones at their
paths, the schema is the one it knows; otherwise the store watch halts it (it then only
says so, and writes nothing)."""

from __future__ import annotations

import os
import time

from apscheduler.schedulers.background import BackgroundScheduler

from models.errors import BrokenInvariant, StoreNotReady, StoreTrouble
from models.schema import require_head
from runners.base.storewatch import FileGuard, StoreWatch, write_back
from workflows.base.context import Context

SCHEMA_EVERY = 2.0  # seconds between checks that the schema is still the one it knows


class StoreTrust:
    """The agent daemon's part that decides whether it may act (runners/agent/daemon.py)."""

    ctx: Context
    watch: StoreWatch | None
    files: FileGuard | None
    _schema_checked: float
    _scheduler: BackgroundScheduler | None

    def may_act(self) -> bool:
        """False once the store cannot be trusted: the files this agent opened are no longer
        the ones at their paths (checked at every round: two stat calls), or the watch
        halted (schema changed, store damaged)."""
        if self.watch is None:
            return True
        if self.watch.acting and self.files is not None:
            changed = self.files.changed()
            if changed is not None:
                self._files_replaced(changed)
        return self.watch.acting

    def _files_replaced(self, which: str) -> None:
        if self.watch is None or self.files is None:
            raise BrokenInvariant("the store watch runs before the store's files are checked")
        db, pid = self.files.db, os.getpid()
        restart = f"restart the agent (`kill {pid}`, then start it again)"
        if which == "wal":
            saved = write_back(self.ctx.store)
            cause = (f"{db.name}-wal was deleted or replaced while the agent ran (its last "
                     "commits were only in the file it still held open)")
            fix = (f"they are written back to {db} now; {restart}" if saved else
                   f"stop the agent with SIGTERM (`kill {pid}`, never kill -9): as it closes "
                   f"the database it writes them back to {db}; then start it again")
        else:
            cause = f"{db} was deleted or replaced while the agent ran (it still has the old file open)"
            fix = f"{restart}: it then uses the file at that path"
        self.watch.halt("replaced", cause, fix)

    def _check_schema(self, now: bool = False) -> None:
        """The schema is still the one this agent knows (a downgrade or an upgrade by a newer
        vigil under it halts it). At most every SCHEMA_EVERY seconds (a small read), and at
        once (`now`) when a statement was refused."""
        if self.watch is None or not self.watch.acting:
            return
        if not now and time.monotonic() - self._schema_checked < SCHEMA_EVERY:
            return
        self._schema_checked = time.monotonic()
        try:
            require_head(self.ctx.store.engine)
        except StoreTrouble as exc:
            self.watch.trouble(exc)
        except StoreNotReady as exc:
            self.watch.halt("schema", f"the schema changed under the running agent: {exc.cause}",
                            "run `vigil db upgrade`, then restart the agent "
                            f"(`kill {os.getpid()}`, then start it again)")

    def _halted(self) -> None:
        """The agent stops acting: its timers stop (scan, backstop, schedules), the sweep
        only says so again now and then."""
        if self._scheduler is not None:
            try:
                self._scheduler.pause()
            except Exception:  # not started yet, or shut down
                pass
