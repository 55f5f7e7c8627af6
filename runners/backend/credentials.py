"""Credentials (`host add --credential NAME=PATH`): secrets that are not env vars. At each
start, each file is copied into a directory of that generation's own,
`<state>/credentials/<generation uuid>/NAME`, readable only by the app's user (dir 0500,
files 0400, owned by it), and named to the app by `$CREDENTIALS_DIRECTORY` (as systemd's
LoadCredential=). The directory is removed once the generation is proven gone. Only the
paths are stored; a value is never in the environment, the store, the events, the logs,
`vigil status` or a plan of `apply`.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from models.store import private_dirs

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}")
MAX_BYTES = 1 << 20  # a credential is a key or a token, not a data set


def check(name: str, path: str) -> str | None:
    """Why `NAME=PATH` cannot be a credential, or None."""
    if not NAME.fullmatch(name):
        return f"{name!r} is not a credential name (letters, digits, '_', '.', '-')"
    try:
        size = os.stat(path).st_size
        with open(path, "rb"):
            pass
    except OSError as exc:
        return f"{path}: cannot read it ({exc.strerror})"
    if size > MAX_BYTES:
        return f"{path} is {size} bytes; a credential holds at most {MAX_BYTES}"
    return None


class Credentials:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir.absolute() / "credentials"

    def place(self, uuid: str, creds: dict[str, str], uid: int | None) -> str:
        """Copy each file in; returns the directory. Raises ValueError naming the file."""
        private_dirs(self.root)
        if uid is not None:  # its user passes through to its own directory only
            os.chmod(self.root, 0o711)
        d = self.root / uuid
        shutil.rmtree(d, ignore_errors=True)  # a start tried again: copied afresh
        d.mkdir(mode=0o700)
        for name, src in creds.items():
            why = check(name, src)
            if why is not None:
                raise ValueError(f"credential {name}: {why}")
            dest = d / name
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                shutil.copyfileobj(f, out)
            if uid is not None:
                os.chown(dest, uid, -1)
        if uid is not None:
            os.chown(d, uid, -1)
        os.chmod(d, 0o500)
        return str(d)

    def forget(self, uuid: str) -> None:
        """After the proof: its directory removed (nothing of it runs to read it)."""
        d = self.root / uuid
        if d.exists():
            os.chmod(d, 0o700)
            shutil.rmtree(d, ignore_errors=True)
