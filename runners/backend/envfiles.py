"""Reading a host's env files, at `host add`/`apply` (checked) and at each start (the
syntax and its rules: workflows/config/envfile.py)."""

from __future__ import annotations

import os

from models.errors import BadInput
from runners.backend.safefiles import read_capped
from workflows.config.envfile import EnvFileError, optional, parse

MAX_BYTES = 1 << 20  # settings, not data: the environment of a process holds far less


def read(entry: str) -> dict[str, str] | None:
    """The assignments of one `--env-file` entry; None for a missing optional file.
    Raises ValueError naming the file (and line) and the fix."""
    path, skip_missing = optional(entry)
    try:  # no link, FIFO or device; at most MAX_BYTES (/dev/zero was a MemoryError)
        raw = read_capped(path, MAX_BYTES)
    except FileNotFoundError:
        if skip_missing:
            return None
        raise ValueError(f"env file {path} does not exist (prefix it with '-' to make it "
                         "optional)") from None
    except ValueError as exc:
        raise ValueError(f"env file {exc}") from None
    try:
        return parse(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"env file {path}:{line}: not UTF-8 text") from None
    except EnvFileError as exc:
        raise ValueError(f"env file {path}:{exc.line}: {exc.reason}") from None


def read_all(entries: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Every file's assignments merged in order (a later file wins). Raises ValueError."""
    env: dict[str, str] = {}
    for entry in entries:
        env.update(read(entry) or {})
    return env


def check_entries(entries: list[str], label: str = "--env-file ") -> list[str]:
    """At `host add` and `apply`: each path absolute (the agent reads it, from wherever it
    runs) and each file that is there readable. Raises BadInput, one line."""
    out = []
    for entry in entries:
        path, opt = optional(entry)
        if not path or "\0" in path:
            raise BadInput(f"{label}{entry!r} is not a path", f"write {label.strip()} /etc/app.env")
        absolute = ("-" if opt else "") + os.path.abspath(path)
        try:
            read(absolute)
        except ValueError as exc:
            raise BadInput(f"{label}{exc}", "fix the file (systemd EnvironmentFile= syntax: "
                           "NAME=value per line) or the path") from None
        out.append(absolute)
    return out
