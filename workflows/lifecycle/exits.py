"""How a generation's leader ended, in the words an operator reads in its `exited` event,
`vigil status` and the metrics: `exited 0`, `exited 3`, `exited 137 (SIGKILL)` (a shell's
128+N for a child it lost to signal N), `killed by SIGKILL`, or `exited (status unknown)`.
Only a process's parent learns its status: a leader this agent did not spawn (one it
adopted after a restart) has none to read."""

from __future__ import annotations

import signal

from sqlalchemy.orm import Session

from models.store import emit
from models.tables import Generation
from workflows.base.context import Context
from workflows.generations.ending import ref_of

UNKNOWN = "exited (status unknown)"


def exit_code(ctx: Context, pid: int | None) -> int | None:
    """The leader's return code when this agent spawned and reaped it (negative: the
    signal that killed it), else None."""
    status = getattr(ctx.proc, "exit_status", None)
    return status(pid) if status is not None and pid is not None else None


def signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def exit_line(code: int | None) -> str:
    if code is None:
        return UNKNOWN
    if code < 0:
        return f"killed by {signal_name(-code) or f'signal {-code}'}"
    shell = signal_name(code - 128) if code > 128 else None
    return f"exited {code} ({shell})" if shell else f"exited {code}"


def oom_line(s: Session, ctx: Context, gen: Generation, code: int | None) -> str | None:
    """In the transaction that retires it: an OOM kill, told by its cgroup's counter (read
    before its cgroups are removed), recorded as `oom_killed`, and the words that say so;
    None when the kernel's OOM killer did not end it."""
    oom = getattr(ctx.proc, "oom_killed", None)
    if oom is not None and oom(ref_of(gen)):
        emit(s, "oom_killed", gen.host, gen.id, exit_code=code, reason="oom")
        return f"oom: killed by the kernel at its memory limit ({exit_line(code)})"
    return None
