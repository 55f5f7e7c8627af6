"""Which translator reads a file: named by --format, else guessed from the file's name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from models.errors import BadInput
from runners.imports import pm2, processcompose, procfile, supervisord
from runners.imports.programs import Imported

READERS: dict[str, Callable[[str], Imported]] = {
    "supervisord": supervisord.read, "procfile": procfile.read, "pm2": pm2.read,
    "process-compose": processcompose.read}


def guess(path: str) -> str | None:
    name = Path(path).name.lower()
    if name.startswith("procfile"):
        return "procfile"
    if name.startswith("ecosystem") and name.endswith((".js", ".cjs", ".json")):
        return "pm2"
    if name.startswith(("process-compose", "compose")) and name.endswith((".yaml", ".yml")):
        return "process-compose"
    if name.endswith((".conf", ".ini")):
        return "supervisord"
    return None


def read(path: str, fmt: str | None) -> Imported:
    fmt = fmt or guess(path)
    if fmt is None:
        raise BadInput(f"cannot tell the format of {path} from its name",
                       f"add --format {'|'.join(READERS)}")
    if not Path(path).is_file():
        raise BadInput(f"{path} is not a file", "pass the path of the configuration to import")
    return READERS[fmt](path)
