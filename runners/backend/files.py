"""The filesystem port: atomic symlink swaps, build staging and digests."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from models.errors import BadInput
from models.statedir import private_dirs


def claim_dropper(claims: Path) -> Callable[[str], None]:
    """The release hook that drops a proven generation's exec claim (a shim's directory
    or a reaper's symlink): the evidence is in the store by then (workflows/lifecycle/jobs.py)."""

    def drop(generation_uuid: str) -> None:
        path = claims / generation_uuid
        try:
            (os.rmdir if path.is_dir() and not path.is_symlink() else os.unlink)(path)
        except OSError:
            pass  # none (not a run), or already dropped

    return drop


class LocalFiles:
    def point_link(self, link: str, target: str) -> None:
        # A new symlink renamed over the old one: readers see the old or the new, never none.
        tmp = f"{link}.tmp{os.getpid()}"
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        os.symlink(target, tmp)
        os.replace(tmp, link)

    def remove_link(self, link: str, only_if_target: str | None = None) -> None:
        if only_if_target is not None and self.read_link(link) != only_if_target:
            return
        try:
            os.unlink(link)
        except FileNotFoundError:
            pass

    def read_link(self, link: str) -> str | None:
        try:
            return os.readlink(link)
        except OSError:
            return None

    def void_claim(self, path: str) -> bool:
        # A symlink, created or not in one call: the shim's mkdir and this never both win.
        private_dirs(os.path.dirname(path))
        try:
            os.symlink("void", path)
            return True
        except FileExistsError:
            return os.path.islink(path)  # ours (an earlier try), or the shim's directory

    def digest(self, path: str) -> str:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()


def forget_host_files(state_dir: Path, host: str) -> None:
    """A removed host's run/ dir (sockets), canonical link and logs go with it, so a host
    added again under the name starts with none of them and shows none of its output."""
    run = state_dir / "run"
    shutil.rmtree(run / host, ignore_errors=True)
    shutil.rmtree(state_dir / "logs" / host, ignore_errors=True)
    try:
        (run / f"{host}.sock").unlink()
    except OSError:
        pass


def staging_root(state_dir: Path) -> Path:
    return state_dir / "builds"


def stage_build(src: str, state_dir: Path, shown: str | None = None) -> tuple[str, str]:
    """Copy an executable into the staging root, named by its sha256; returns (path, digest).
    Messages name it as `shown` (the path as the operator typed it) when given."""
    path = Path(src)
    src = shown if shown is not None else src
    if not path.exists():
        raise BadInput(f"build {src} does not exist", "pass the path of an executable file")
    if not path.is_file():
        raise BadInput(f"build {src} is not a regular file", "pass the path of an executable file")
    if not os.access(path, os.X_OK):
        if path.is_symlink():  # chmod would change the link's target, whatever that is
            raise BadInput(f"build {src} is a symlink to {path.resolve()}, which is not executable",
                           "check that the link points at the build you meant, and pass an "
                           "executable file (vigil never suggests changing a link's target)")
        raise BadInput(f"build {src} is not executable", f"run `chmod +x {src}`")
    root = staging_root(state_dir)
    private_dirs(root)
    # What is hashed is what is copied: the bytes go to a temporary file in the root while
    # they are hashed (a build replaced meanwhile cannot end up under another's digest), and
    # only then is it renamed to its digest.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp", dir=root)  # one per stager
    tmp = Path(name)
    try:
        try:
            digest = _copy_hashing(path, fd)
        except OSError as e:  # a write to an fd names no file: name it (a full disk is ours)
            raise e if e.filename else OSError(e.errno, e.strerror, str(tmp)) from e
        dest = root / digest / path.name
        if not _holds(dest, digest):  # missing, or not what its name says: (re)placed
            private_dirs(dest.parent)
            os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk, say, or the same build staged already
    return str(dest), digest


def _copy_hashing(src: Path, fd: int) -> str:
    h = hashlib.sha256()
    mode = stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
    with open(fd, "wb") as out, open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)
        out.flush()
        os.fchmod(out.fileno(), mode)  # whatever the umask
    return h.hexdigest()


def _holds(dest: Path, digest: str) -> bool:
    try:
        return LocalFiles().digest(str(dest)) == digest and os.access(dest, os.X_OK)
    except OSError:
        return False
