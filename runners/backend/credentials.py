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

from models.statedir import private_dirs
from runners.backend.safefiles import read_capped

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}")
MAX_BYTES = 1 << 20  # a credential is a key or a token, not a data set


def load(name: str, path: str) -> bytes:
    """The source's bytes, read once (what is checked is what is copied) as safefiles reads
    them, at most MAX_BYTES. Raises ValueError, one line."""
    if not NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a credential name (letters, digits, '_', '.', '-')")
    try:
        return read_capped(path, MAX_BYTES)
    except FileNotFoundError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None


def check(name: str, path: str) -> str | None:
    """Why `NAME=PATH` cannot be a credential, or None."""
    try:
        load(name, path)
    except ValueError as exc:
        return str(exc)
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
        try:
            for name, src in creds.items():
                self._copy(d / name, name, src, uid)
        except (ValueError, OSError) as exc:
            shutil.rmtree(d, ignore_errors=True)  # a refused start leaves no part copied
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"credentials cannot be copied into {d} ({exc.strerror})") from None
        if uid is not None:
            os.chown(d, uid, -1)
        os.chmod(d, 0o500)
        return str(d)

    @staticmethod
    def _copy(dest: Path, name: str, src: str, uid: int | None) -> None:
        try:
            data = load(name, src)
        except ValueError as exc:
            raise ValueError(f"credential {name}: {exc}") from None
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        if uid is not None:
            os.chown(dest, uid, -1)

    def forget(self, uuid: str) -> None:
        """After the proof: its directory removed (nothing of it runs to read it)."""
        d = self.root / uuid
        if d.exists():
            os.chmod(d, 0o700)
            shutil.rmtree(d, ignore_errors=True)
