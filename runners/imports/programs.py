"""What every format's translator shares: a program as hosts-file keys, a command line as
the build vigil stages and its args, host names, and the keys that do not map."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.errors import BadInput

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # as workflows/config/hosts.py's NAME
MAX_SECONDS = 86400.0  # the hosts file's bound on every seconds key


@dataclass
class Program:
    """One host of the output: its name and hosts-file keys, in the order written."""
    name: str
    keys: dict[str, Any] = field(default_factory=dict)


@dataclass
class Imported:
    source: str  # the file read
    fmt: str
    programs: list[Program] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)  # "WHERE: KEY = VALUE: why", one a key

    def skip(self, where: str, key: str, value: Any, why: str) -> None:
        shown = value if isinstance(value, str) else repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        self.unmapped.append(f"{where}: {key} = {shown}: {why}")


    def keep_known(self, known: set[str]) -> None:
        """Keys this vigil's hosts file does not have (yet) moved to the unmapped lines."""
        for p in self.programs:
            for k in [k for k in p.keys if k not in known]:
                self.skip(f"host {p.name}", k, p.keys.pop(k), f"vigil has no `{k}` key yet")


def host_name(raw: str, source: str) -> str:
    """A program's name as a host name: lowercase, '_', '.' and ':' become '-'."""
    name = re.sub(r"[^a-z0-9-]", "-", raw.strip().lower()).strip("-")
    if not NAME.fullmatch(name):
        raise BadInput(f"{source}: program name {raw!r} makes no host name",
                       "rename it to 1-63 letters, digits, '-' or '_'")
    return name


def command_keys(words: list[str], cwd: str | None, env: dict[str, str], source: str,
                 where: str) -> dict[str, Any]:
    """`build` and `args` of a command line: the program it names, found as an exec would
    find it (a name without '/' on the PATH the program gets, else relative to its
    directory), and the words after it. vigil stages that executable and runs it with the
    args in `cwd`, so the process's argv after argv[0] is the original's."""
    if not words:
        raise BadInput(f"{source}: {where}: empty command", "give the program a command")
    first = words[0]
    if "/" in first:
        joined = os.path.join(cwd or os.path.dirname(source) or ".", first)
        found: str | None = os.path.abspath(joined) if os.path.isfile(joined) else None
    else:
        found = shutil.which(first, path=env.get("PATH", os.environ.get("PATH", os.defpath)))
    if found is None or not os.access(found, os.X_OK):
        raise BadInput(f"{source}: {where}: {first!r} is not an executable file here",
                       "install it (or correct the command), then import again")
    keys: dict[str, Any] = {"build": found}
    if words[1:]:
        keys["args"] = list(words[1:])
    return keys


def shell_keys(shell: str, flag: str, command: str, env: dict[str, str], source: str,
               where: str) -> dict[str, Any]:
    """A command the original tool runs through a shell (Procfile, process-compose)."""
    return command_keys([shell, flag, command], None, env, source, where)


def directory(path: str, base: Path, source: str, where: str) -> str:
    full = (base / path).resolve()
    if not full.is_dir():
        raise BadInput(f"{source}: {where}: directory {path!r} does not exist",
                       "create it or correct the path, then import again")
    return str(full)


def start_limit(starts: int, quick: float) -> str:
    """N quick exits in a window that holds them under vigil's backoff (each at most
    restart_cap, 30 s by default, plus the time up): N/SECONDS for `start_limit`."""
    window = min(MAX_SECONDS, starts * (30.0 + quick))
    return f"{starts}/{window:g}"


def seconds(value: float) -> float | int:
    value = min(MAX_SECONDS, float(value))
    return int(value) if value == int(value) else value


def unique(programs: list[Program], source: str) -> None:
    seen: set[str] = set()
    for p in programs:
        if p.name in seen:
            raise BadInput(f"{source}: two programs make host {p.name}",
                           "rename one of them (host names are lowercase; '_' becomes '-')")
        seen.add(p.name)
