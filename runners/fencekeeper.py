"""The box's fence keeper: a small process of its own (own session, started by the agent)
that kills the box's contestable generations when the agent's self-fence deadline passes.

It outlives the agent on purpose: an agent that is SIGKILLed or SIGSTOPped cannot fence
itself, but its keeper still can. The agent writes `<state>/fence.json` after every lease
renewal (and before every spawn): the deadline on CLOCK_MONOTONIC (shared by every process
of the machine) and the generations another box could take over. Past the deadline the
keeper SIGKILLs each of them (containment and marker, pid-verified) until the agent writes
a later deadline; it exits once the agent is gone and nothing it guards is left alive.

Run as `python -m runners.fencekeeper STATE_DIR`; one per state dir (flock on fence.lock).
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from runners.process import ProcessBackend, _matches
from workflows.ports import ProcRef

FENCE_FILE = "fence.json"
KEEPER_LOCK = "fence.lock"
POLL = 0.05  # how late past the deadline the first SIGKILL may come
REKILL = 0.5  # how often a fired deadline re-kills what is still alive


def write_fence(state_dir: Path, data: dict[str, Any]) -> None:
    path = state_dir / FENCE_FILE
    tmp = path.with_suffix(".tmp")
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
    try:
        f = open(state_dir / KEEPER_LOCK, "a+")
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
        return None


def _log(msg: str) -> None:
    print(f"ts={time.strftime('%Y-%m-%dT%H:%M:%S')} logger=vigil.fencekeeper {msg}",
          file=sys.stderr, flush=True)


def run(state_dir: Path) -> int:
    lock = open(state_dir / KEEPER_LOCK, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another keeper guards this box
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    backend = ProcessBackend("marker")  # kill_all needs only the recorded containment
    _log(f"started pid={os.getpid()} state_dir={state_dir}")
    fired_at = 0.0
    while True:
        data = read_fence(state_dir) or {}
        gens = [ProcRef(g["uuid"], g.get("pid"), g.get("create_time"), g.get("cgroup"))
                for g in data.get("generations", [])]
        now = time.monotonic()
        past = bool(gens) and now >= float(data.get("deadline", 0.0))
        if past and now - fired_at >= REKILL:
            alive = [g for g in gens if not backend.proven(g)]
            for g in alive:
                backend.kill_all(g)
            if alive:
                _log(f"self-fence fired late_by={now - data['deadline']:.3f}s killed="
                     f"{','.join(g.generation_uuid for g in alive)}")
            fired_at = now
        agent = _matches(data.get("agent_pid"), data.get("agent_ctime"))
        if not agent and (not gens or (past and all(backend.proven(g) for g in gens))):
            _log("agent gone and nothing left to guard: exiting")
            return 0
        time.sleep(POLL)


if __name__ == "__main__":
    sys.exit(run(Path(sys.argv[1])))
