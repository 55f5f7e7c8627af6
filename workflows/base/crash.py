"""Named crash points at every step boundary.

With VIGIL_CRASH_AT=<name> (or <name>#<k> for its k-th hit) the process SIGKILLs itself
when it reaches that point, so recovery tests can stop the agent at any boundary.
`*` stands for any point: VIGIL_CRASH_AT=*#<k> dies at the k-th point reached, whatever
its name (the recovery suite's double crashes use it to die during a recovery without
knowing in advance which point that recovery reaches first).
The point is logged (logger vigil.crash) just before the kill, so a test can tell which.
Every name is registered at import, so `vigil crashpoints` lists them without running.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from models.errors import BrokenInvariant

REGISTERED: dict[str, str] = {}  # name -> what has just happened when it is reached
ANY = "*"
_hits: dict[str, int] = {}
_lock = threading.Lock()
log = logging.getLogger("vigil.crash")


def define(name: str, after: str) -> str:
    if name in REGISTERED:
        raise BrokenInvariant(f"crash point {name} defined twice")
    REGISTERED[name] = after
    return name


def crashpoint(name: str) -> None:
    if name not in REGISTERED:
        raise BrokenInvariant(f"crash point {name} is not defined")
    target = os.environ.get("VIGIL_CRASH_AT")
    if not target:
        return
    wanted, _, nth = target.partition("#")
    if wanted not in (name, ANY):
        return
    with _lock:
        _hits[wanted] = _hits.get(wanted, 0) + 1
        if _hits[wanted] < int(nth or 1):
            return
        # Held to the end: another thread reaching a point now must not log a second name.
        log.warning("crash point=%s at=%s", name, target)
        os.kill(os.getpid(), signal.SIGKILL)
