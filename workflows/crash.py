"""Named crash points at every step boundary.

With VIGIL_CRASH_AT=<name> (or <name>#<k> for its k-th hit) the process SIGKILLs itself
when it reaches that point, so recovery tests can stop the agent at any boundary.
Every name is registered at import, so `vigil crashpoints` lists them without running.
"""

from __future__ import annotations

import os
import signal
import threading

REGISTERED: dict[str, str] = {}  # name -> what has just happened when it is reached
_hits: dict[str, int] = {}
_lock = threading.Lock()


def define(name: str, after: str) -> str:
    assert name not in REGISTERED, f"crash point {name} defined twice"
    REGISTERED[name] = after
    return name


def crashpoint(name: str) -> None:
    assert name in REGISTERED, f"crash point {name} is not defined"
    target = os.environ.get("VIGIL_CRASH_AT")
    if not target:
        return
    wanted, _, nth = target.partition("#")
    if wanted != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        hit = _hits[name]
    if hit >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
