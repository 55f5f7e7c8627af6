"""The box's fence keeper: a small process of its own (own session, started by the agent)
that kills the box's contestable generations when the agent's self-fence deadline passes.

It outlives the agent on purpose: an agent that is SIGKILLed or SIGSTOPped cannot fence
itself, but its keeper still can. The agent writes `<state>/fence.json` after every lease
renewal (and before every spawn): the deadline on CLOCK_MONOTONIC (shared by every process
of the machine) and the generations another box could take over. Past the deadline the
keeper SIGKILLs each of them (containment and marker, pid-verified) until the agent writes
a later deadline; it exits once the agent is gone and nothing it guards is left alive.

Run as `python -m runners.keepers.fencekeeper STATE_DIR`; one per state dir (flock on fence.lock).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from runners.base.doorbell import lock_holder
from runners.base.pids import carriers, kill_leader, matches, signal_same
from runners.keepers.wire import claim, log_line

FENCE_FILE = "fence.json"
KEEPER_LOCK = "fence.lock"
POLL = 0.05  # how late past the deadline the first SIGKILL may come
REKILL = 0.5  # how often a fired deadline re-kills what is still alive


def write_fence(state_dir: Path, data: dict[str, Any]) -> None:
    path = state_dir / FENCE_FILE
    # A temporary of its own per writer: the renewal thread and every drive's spawn guard
    # write at once, and a shared name let one rename the other's file away (ENOENT).
    tmp = path.with_name(f".{FENCE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_fence(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / FENCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def keeper_pid(state_dir: Path) -> int | None:
    """The pid of the running keeper of this state dir, or None."""
    return lock_holder(state_dir / KEEPER_LOCK)


def fence(gens: list[dict[str, Any]]) -> int:
    """SIGKILL everything of these generations: each cgroup and leader's session group
    first (instant), then every marker carrier found in one scan. Returns how many live
    processes the scan found (0: all gone)."""
    for g in gens:
        kill_leader(g.get("cgroup"), g.get("pid"), g.get("create_time"))
    left = carriers({g["uuid"] for g in gens})
    for pid, (_, ctime) in left.items():
        signal_same(pid, ctime, signal.SIGKILL)
    return len(left)


def run(state_dir: Path) -> int:
    lock = claim(state_dir / KEEPER_LOCK)
    if lock is None:
        return 0  # another keeper guards this box
    log_line("fencekeeper", f"started pid={os.getpid()} state_dir={state_dir}")
    fired_at = 0.0
    left = 0
    while True:
        data = read_fence(state_dir) or {}
        gens = data.get("generations", [])
        now = time.monotonic()
        past = bool(gens) and now >= float(data.get("deadline", 0.0))
        if past and now - fired_at >= REKILL:
            first = fired_at == 0.0 or left
            left = fence(gens)
            if first:
                log_line("fencekeeper", f"self-fence fired late_by={now - data['deadline']:.3f}s "
                         f"took={time.monotonic() - now:.3f}s generations={len(gens)} "
                         f"still_found={left}")
            fired_at = now
        elif not past:
            fired_at, left = 0.0, 0
        agent = matches(data.get("agent_pid"), data.get("agent_ctime"))
        if not agent and (not gens or (past and fired_at and not left)):
            log_line("fencekeeper", "agent gone and nothing left to guard: exiting")
            return 0
        time.sleep(POLL)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
