"""A host's own way to be asked to stop (`--stop-signal`, `--stop-command`): the first step
of every drain (a stop, a retiring generation after a deploy, a scale-down, shutdown's
stops). The drain timeout still ends it with SIGKILL and the proof, whatever the app or
its stop command does.

- stop signal: a signal name (TERM, QUIT, ...; stored without the SIG prefix), sent to the
  leader (or, with the leader gone on a shared listener, to what is left of it).
- stop command: `/bin/sh -c CMD` instead of the signal, run inside the generation's own
  containment as the app's user with the host's environment plus `MAINPID`/`VIGIL_PID`
  (the leader), so it is bounded by the same drain deadline and proof, and an agent that
  dies while it runs leaves nothing outside the generation (runners/backend/stopcmd.py).

Both are read from the host row when the first signal is sent, and again when an agent
that died after the intent sends it again: the row says what is sent."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

from models.errors import BadInput
from models.tables import Generation, Host
from workflows.base.ports import SpawnSpec

DEFAULT = "TERM"
# SIGSTOP cannot be caught and stops nothing: the app would sit frozen until the SIGKILL.
REFUSED = {"STOP": "SIGSTOP freezes the app instead of stopping it"}
MAX_COMMAND = 4096  # characters of a stop command


def parse_signal(text: object, label: str = "--stop-signal ") -> str:
    """'TERM', 'SIGTERM', 'sigquit', '15' -> 'TERM' / 'QUIT' (the stored name). Raises
    BadInput (one line) for anything else."""
    raw = str(text).strip() if isinstance(text, (str, int)) and not isinstance(text, bool) else ""
    name = raw.upper().removeprefix("SIG")
    if raw.isdigit():
        try:
            name = signal.Signals(int(raw)).name.removeprefix("SIG")
        except ValueError:
            name = ""
    if name in REFUSED:
        raise BadInput(f"{label}{text!r}: {REFUSED[name]}",
                       f"give a signal the app handles, e.g. {label.strip() or 'stop_signal ='} QUIT")
    if not name or not name.isalnum() or not hasattr(signal, "SIG" + name):
        raise BadInput(f"{label}{text!r} is not a signal",
                       "give a name or number such as TERM, QUIT, INT, HUP, USR1 or 15 "
                       "(`kill -l` lists them)")
    return name


def signal_number(name: str | None) -> int:
    """The stored name's number; TERM for a name this box does not know (a row written by
    hand or on another platform: the drain still ends in SIGKILL)."""
    try:
        return int(getattr(signal, "SIG" + (name or DEFAULT)))
    except (AttributeError, TypeError):
        return int(signal.SIGTERM)


def check_command(command: str | None, label: str = "--stop-command ") -> str | None:
    """None or '' (no command) -> None; else the command, checked: one /bin/sh -c line."""
    if command is None or command == "":
        return None
    if not isinstance(command, str):
        raise BadInput(f"{label}must be a string", 'write e.g. stop_command = "nginx -s quit"')
    if "\0" in command:
        raise BadInput(f"{label}contains a NUL byte", "remove the NUL (\\0) character")
    if not command.strip():
        raise BadInput(f"{label}is blank", "give a command, or unset it to send the stop signal")
    if len(command) > MAX_COMMAND:
        raise BadInput(f"{label}is {len(command)} characters long (at most {MAX_COMMAND})",
                       "put it in a script and give the script's path")
    return command


@dataclass(frozen=True)
class StopWay:
    """How one generation is asked to stop: its host's signal, or its host's command."""

    signal: str = DEFAULT
    command: str | None = None
    spec: SpawnSpec | None = None  # the command's process, when there is one

    @property
    def signum(self) -> int:
        return signal_number(self.signal)

    def said(self) -> str:
        return f"`{self.command}`" if self.command else f"SIG{self.signal}"


TERM = StopWay()


def stop_way(host: Host | None, gen: Generation) -> StopWay:
    """The host's way for `gen` (TERM when the host row is gone)."""
    if host is None:
        return TERM
    name = host.stop_signal or DEFAULT
    if not host.stop_command:
        return StopWay(name)
    pid = str(gen.pid or "")
    env = {**json.loads(host.env), "MAINPID": pid, "VIGIL_PID": pid}
    spec = SpawnSpec(generation_uuid=gen.uuid, host=host.name,
                     argv=["/bin/sh", "-c", host.stop_command], env=env, cwd=host.cwd,
                     socket_path=gen.socket, cgroup=gen.cgroup, user=host.run_user,
                     group=host.run_group, env_files=tuple(json.loads(host.env_files or "[]")))
    return StopWay(name, host.stop_command, spec)
