"""The one restart policy of workers and instances: an exit within `restart_reset` of its
start is quick, a slot's quick exits in a row its streak (models/streaks.py), the next start
waits floor * 2**n capped, then ±20 % jitter (so hosts that crashed together do not restart in
lockstep), a streak of CRASHLOOP_STREAK still waiting is a crashloop. Given by callers: a worker
restarts its captured build; an instance at streak 0 restarts at once. With a start limit
(`--start-limit N/SECONDS`), the slot's N-th quick exit within SECONDS makes it `failed`: no
restart is queued, a `failed` event says so, and only `vigil retry`, a wake or a deploy
(models/streaks.py clear_failed) brings it back.

How a leader ended, in the words an operator reads in its `exited` event, `vigil status` and
the metrics: `exited 0`, `exited 3`, `exited 137 (SIGKILL)` (a shell's 128+N for a child it
lost to signal N), `killed by SIGKILL`, or `exited (status unknown)`. Only a process's parent
learns its status: a leader this agent did not spawn (one it adopted) has none to read."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from models.errors import BadInput
from models.states import CRASHLOOP_STREAK, WakeState
from models.store import emit, utcnow
from models.streaks import fail_slot, quick_exits, set_streak, streaks
from models.tables import Generation, Host, Wake
from workflows.base.context import Context
from workflows.base.pacing import exponential
from workflows.base.queue import enqueue_wake
from workflows.generations.ending import ref_of

UNKNOWN = "exited (status unknown)"
JITTER = 0.2  # each restart delay is drawn within ±20 % of the policy's


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


def restart_delay(host: Host, n: int, rand: Callable[[], float] = random.random) -> float:
    """floor * 2**n, capped, then jittered by ±JITTER: the wait before the next start after
    `n` quick exits. `rand` draws from [0, 1) (a test passes its own)."""
    return exponential(n + 1, host.restart_floor, host.restart_cap) * (
        1.0 + JITTER * (2.0 * rand() - 1.0))


def parse_start_limit(text: str, label: str = "--start-limit ") -> str:
    """`N/SECONDS` (N at least 1, SECONDS above 0 and at most a day), written back as the
    column holds it; refused in one line."""
    burst, _, seconds = str(text).strip().partition("/")
    try:
        n, secs = int(burst), float(seconds)
    except ValueError:
        n, secs = 0, 0.0
    if n < 1 or not 0 < secs <= 86400:
        raise BadInput(f"{label}{text!r} is not N/SECONDS",
                       "give the starts and the window, such as 5/60 (5 quick exits in 60 s "
                       "make the host failed)")
    return f"{n}/{secs:g}"


def start_limit(host: Host) -> tuple[int, float] | None:
    """The host's start limit as (N, SECONDS), or None."""
    if host.start_limit is None:
        return None
    burst, _, seconds = host.start_limit.partition("/")
    return int(burst), float(seconds)


def start_window(s: Session, host: Host, slot: int, up: float, now: float) -> list[float] | None:
    """The slot's quick exits inside its start limit's window, this one included (a stable
    run empties it); None when the host has no start limit."""
    limit = start_limit(host)
    if limit is None:
        return None
    if up >= host.restart_reset:
        return []
    kept = [t for t in quick_exits(s, host.name, slot) if t > now - limit[1]] + [now]
    return kept[-limit[0]:]


def schedule(s: Session, host: Host, up: float, why: str, *, slot: int = 0,
             build_id: int | None = None, at_once: bool = False,
             rand: Callable[[], float] = random.random) -> None:
    """Queue the restart of `slot` (onto `build_id`, None: the live build) after `up`
    seconds up, and count it in the slot's streak. `at_once`: the first exit after a
    stable run costs no wait. A slot at its start limit is failed instead."""
    n = 0 if up >= host.restart_reset else streaks(s, [host.name]).get((host.name, slot), 0)
    at = utcnow()
    window = start_window(s, host, slot, up, at.replace(tzinfo=UTC).timestamp())
    set_streak(s, host.name, slot, n + 1, window)
    limit = start_limit(host)
    if window is not None and limit is not None and len(window) >= limit[0]:
        fail_slot(s, host.name, slot, at)
        emit(s, "failed", host.name, reason=why, start_limit=host.start_limit,
             quick_exits=len(window), uptime=round(up, 3), **({"slot": slot} if slot else {}))
        return
    delay = 0.0 if at_once and n == 0 else restart_delay(host, n - at_once, rand)
    enqueue_wake(s, host.name, "restart", build_id=build_id, delay=delay, slot=slot)
    emit(s, "restart_scheduled", host.name, delay=round(delay, 3), streak=n + 1,
         uptime=round(up, 3), reason=why, **({"slot": slot} if slot else {}),
         **({"build_id": build_id} if build_id is not None else {}))


def crashloop(n: int, wakes: list[Wake], now: datetime) -> bool:
    """Quick exits in a row, the next start waiting out its backoff."""
    return n >= CRASHLOOP_STREAK and any(
        w.cause == "restart" and w.state is WakeState.queued and w.next_attempt_at > now
        for w in wakes)
