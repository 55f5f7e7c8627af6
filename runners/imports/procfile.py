"""A Procfile (Heroku, honcho, foreman): `name: command` lines, each command run by
`/bin/sh -c` in the app's directory, with the `.env` beside it and `PORT` given as honcho
gives it (5000, then 100 more for each process type after the first; `PORT` in `.env`
moves the base)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from models.errors import BadInput
from runners.imports.programs import Imported, Program, host_name, shell_keys, unique

LINE = re.compile(r"^([A-Za-z0-9_-]+):\s*(.+)$")  # honcho's own
BASE_PORT = 5000


def dotenv(path: Path) -> dict[str, str]:
    """A `.env` file as honcho reads it: KEY=value lines, shell-quoted."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}", "make the .env readable UTF-8 text") from None
    out = {}
    for line in text.splitlines():
        try:
            tokens = list(shlex.shlex(line, posix=True))
        except ValueError as exc:
            raise BadInput(f"{path}: {line!r}: {exc}", "correct the quoting") from None
        if len(tokens) >= 3 and tokens[1] == "=" and re.match(r"[A-Za-z_]\w*$", tokens[0]):
            out[tokens[0]] = "".join(tokens[2:]).replace(r"\n", "\n").replace(r"\t", "\t")
    return out


def read(path: str) -> Imported:
    out = Imported(path, "procfile")
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}", "pass a readable Procfile") from None
    base = source.resolve().parent
    env = dotenv(base / ".env")
    port = int(env["PORT"]) if env.get("PORT", "").isdigit() else BASE_PORT
    for number, line in enumerate(text.splitlines(), 1):
        m = LINE.match(line)
        if m is None:
            if line.strip() and not line.lstrip().startswith("#"):
                out.skip(f"line {number}", "line", line, "not `name: command` (honcho skips it too)")
            continue
        name, command = m.groups()
        keys = {"kind": "worker", **shell_keys("/bin/sh", "-c", command, env, path, name),
                "cwd": str(base), "env": {**env, "PORT": str(port)}, "running": True}
        port += 100
        out.programs.append(Program(host_name(name, path), keys))
    if not out.programs:
        raise BadInput(f"{path}: no `name: command` line", "is it a Procfile? each line is "
                       "`web: command`")
    unique(out.programs, path)
    return out
