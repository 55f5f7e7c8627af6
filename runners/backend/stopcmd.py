"""A host's stop command (workflows/generations/stopway.py), run instead of its stop signal.

`/bin/sh -c CMD` is started inside the generation's own containment: in its cgroup (the
same join shim as the app's), carrying its marker, as the app's user, with the host's
environment (env files read now) and MAINPID / VIGIL_PID. So the drain deadline's SIGKILL
and the proof reach it like any process of the app, and an agent that dies while it runs
leaves nothing behind that the next agent's proof would not find. Its output (the last
lines, for the event) goes to a file of its own that is already unlinked; this agent keeps
its handle to read its exit."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import IO

from runners.backend import users
from runners.backend.launch import base_environment, command, environment
from workflows.base.ports import SpawnError, SpawnSpec

TAIL = 300  # characters of its output an event carries


@dataclass
class _Running:
    proc: subprocess.Popen[bytes]
    out: IO[bytes]


def contained(spec: SpawnSpec) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start `spec.argv` inside the generation's containment
    (its cgroup's join shim, its marker, its user by setpriv): a stop command's, a probe
    command's (runners/backend/readysignal.py). Raises SpawnError (a gone user, a bad env
    file)."""
    env = base_environment()
    try:
        who = users.switch_for(spec.user, spec.group)
        if who is not None:
            env.update(who.env())
            users.setpriv_tool()
        from runners.backend.envfiles import read_all

        env.update(read_all(spec.env_files))
    except ValueError as exc:
        raise SpawnError(f"host {spec.host}: {exc}", build_fault=False) from exc
    env = environment(spec, env)
    cg = spec.cgroup if spec.cgroup and os.path.isdir(spec.cgroup) else None
    return command(spec, cg, users.shim_target(who, spec)), env


class StopCommands:
    def __init__(self) -> None:
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()

    def start(self, spec: SpawnSpec) -> None:
        """Start it (the previous one of this generation, if any, is left to the drain).
        Raises SpawnError when it cannot start (a gone user, a bad env file, no cgroup)."""
        argv, env = contained(spec)
        out = tempfile.TemporaryFile()  # noqa: SIM115 - kept open until its outcome is read
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    cwd=spec.cwd, env=env, start_new_session=True,
                                    close_fds=True)
        except (OSError, ValueError) as exc:
            out.close()
            raise SpawnError(f"stop command: {exc}", build_fault=False) from exc
        with self._lock:
            old = self._running.pop(spec.generation_uuid, None)
            self._running[spec.generation_uuid] = _Running(proc, out)
        if old is not None:
            old.out.close()

    def running(self, generation_uuid: str) -> bool:
        with self._lock:
            r = self._running.get(generation_uuid)
        return r is not None and r.proc.poll() is None

    def outcome(self, generation_uuid: str) -> str | None:
        """What it did, once, then forgotten: `exit 0`, `exit 3: <last line>`, `killed by
        signal 9`, or `still running` (the drain's SIGKILL follows); None when this agent
        did not start one (it started before the agent's restart)."""
        with self._lock:
            r = self._running.pop(generation_uuid, None)
        if r is None:
            return None
        try:
            rc = r.proc.poll()
            r.out.seek(0, os.SEEK_END)
            r.out.seek(max(0, r.out.tell() - 4 * TAIL))
            text = r.out.read().decode(errors="replace").strip().splitlines()
        finally:
            r.out.close()
        last = (": " + text[-1][-TAIL:]) if text else ""
        if rc is None:
            return "still running" + last
        return (f"killed by signal {-rc}" if rc < 0 else f"exit {rc}") + last
