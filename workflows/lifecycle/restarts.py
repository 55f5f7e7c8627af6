"""The one restart policy of workers and instances: an exit within `restart_reset` of its
start is quick, a slot's quick exits in a row its streak (models/streaks.py), the next start
waits floor * 2**n capped, a streak of CRASHLOOP_STREAK still waiting is a crashloop. Given
by callers: a worker restarts its captured build; an instance at streak 0 restarts at once.

How a leader ended, in the words an operator reads in its `exited` event, `vigil status` and
the metrics: `exited 0`, `exited 3`, `exited 137 (SIGKILL)` (a shell's 128+N for a child it
lost to signal N), `killed by SIGKILL`, or `exited (status unknown)`. Only a process's parent
learns its status: a leader this agent did not spawn (one it adopted) has none to read."""

from __future__ import annotations

import signal
from datetime import datetime

from sqlalchemy.orm import Session

from models.states import CRASHLOOP_STREAK, WakeState
from models.store import emit, utcnow
from models.streaks import set_streak, streaks
from models.tables import Generation, Host, Wake
from workflows.base.context import Context
from workflows.base.pacing import exponential
from workflows.base.queue import enqueue_wake
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


def uptime(gen: Generation) -> float:
    return (utcnow() - gen.current_at).total_seconds() if gen.current_at else 0.0


def restart_delay(host: Host, n: int) -> float:
    """floor * 2**n, capped: the wait before the next start after `n` quick exits."""
    return exponential(n + 1, host.restart_floor, host.restart_cap)


def schedule(s: Session, host: Host, up: float, why: str, *, slot: int = 0,
             build_id: int | None = None, at_once: bool = False) -> None:
    """Queue the restart of `slot` (onto `build_id`, None: the live build) after `up`
    seconds up, and count it in the slot's streak. `at_once`: the first exit after a
    stable run costs no wait."""
    n = 0 if up >= host.restart_reset else streaks(s, [host.name]).get((host.name, slot), 0)
    delay = 0.0 if at_once and n == 0 else restart_delay(host, n - at_once)
    enqueue_wake(s, host.name, "restart", build_id=build_id, delay=delay, slot=slot)
    set_streak(s, host.name, slot, n + 1)
    emit(s, "restart_scheduled", host.name, delay=round(delay, 3), streak=n + 1,
         uptime=round(up, 3), reason=why, **({"slot": slot} if slot else {}),
         **({"build_id": build_id} if build_id is not None else {}))


def crashloop(n: int, wakes: list[Wake], now: datetime) -> bool:
    """Quick exits in a row, the next start waiting out its backoff."""
    return n >= CRASHLOOP_STREAK and any(
        w.cause == "restart" and w.state is WakeState.queued and w.next_attempt_at > now
        for w in wakes)
