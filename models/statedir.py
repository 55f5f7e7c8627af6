"""The state directory: made 0700 from its first moment, refused when it is a link, a
file, another user's, or out of reach (each said in one line with its fix)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from models.errors import StoreNotReady


def private_dirs(path: Path | str) -> None:
    """`mkdir -p` where every directory made is 0700 from its first moment: makedirs gives
    the ones in between the umask's mode (0777 under umask 000). The directory itself is
    tried first (every wake makes its host's log dir, whose parent is there): one mkdir,
    the parents only when it says one is missing."""
    p = os.fspath(path)
    if not os.path.isabs(p):
        p = os.path.join(os.getcwd(), p)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        return  # there already (or made meanwhile by another process)
    except FileNotFoundError:
        parent = os.path.dirname(p)
        if parent == p:
            raise
        private_dirs(parent)
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            pass


def _unreachable_dir(state_dir: Path, exc: OSError) -> StoreNotReady:
    """A state dir that cannot be looked at or made, said with the path in the way."""
    blocker = state_dir
    for parent in [state_dir, *state_dir.parents]:
        try:
            st = parent.stat()
        except FileNotFoundError:
            continue
        except OSError:
            continue  # not even searchable: a parent further up says why
        blocker = parent
        break
    else:
        st = None
    uid = os.geteuid()
    fix = "pass --state-dir (or VIGIL_HOME) naming another directory"
    if isinstance(exc, NotADirectoryError) or (st is not None and not stat.S_ISDIR(st.st_mode)):
        return StoreNotReady(f"the state directory {state_dir} cannot be made: {blocker} is a "
                             "file, not a directory", fix)
    if st is not None and blocker != state_dir and st.st_uid != uid:
        who = f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"
        return StoreNotReady(f"the state directory {state_dir} is out of reach: {blocker} is "
                             f"{who} and uid {uid} may not {'enter' if not os.access(blocker, os.X_OK) else 'write in'} it",
                             f"run vigil as uid {st.st_uid}, or {fix}")
    return StoreNotReady(f"the state directory {state_dir} is out of reach ({exc.strerror}: "
                         f"{exc.filename or blocker})", f"make {blocker} writable by uid {uid}, or {fix}")


def prepare_state_dir(state_dir: Path) -> Path:
    """Create the state directory 0700 (and refuse one owned by someone else, or a link)."""
    state_dir = state_dir.absolute()
    try:
        return _prepare_state_dir(state_dir)
    except OSError as exc:
        raise _unreachable_dir(state_dir, exc) from None


def state_dir_exists(state_dir: Path) -> bool:
    try:
        return state_dir.exists()
    except OSError as exc:  # a parent that uid may not search
        raise _unreachable_dir(state_dir.absolute(), exc) from None


def refuse_link(state_dir: Path) -> None:
    """A state dir that is a symbolic link is refused before anything reads or writes it:
    vigil makes its state dir 0700 and writes into it, so a link planted where others can
    write (`ln -s /etc /tmp/.vigil`) would aim that at any directory."""
    try:
        target = os.readlink(state_dir)
    except OSError:
        return  # not a link (or not there): the other checks say what is wrong
    raise StoreNotReady(f"state directory {state_dir} is a symbolic link (to {target}); "
                        "vigil follows none there, as one planted by another user would have "
                        "it lock down and write into the target",
                        "pass --state-dir (or VIGIL_HOME) naming a real directory of your own")


def _prepare_state_dir(state_dir: Path) -> Path:
    refuse_link(state_dir)
    if not os.path.lexists(state_dir):
        private_dirs(state_dir)
    try:  # opened without following a link swapped in since: its mode set on what was opened
        fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        refuse_link(state_dir)
        if exc.errno != errno.ENOTDIR:
            raise
        raise StoreNotReady(
            f"state directory {state_dir} is not a directory",
            "pass --state-dir (or VIGIL_HOME) naming a directory",
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise StoreNotReady(
                f"state directory {state_dir} is owned by uid {st.st_uid}, not by you "
                f"(uid {os.geteuid()})",
                "run vigil as its owner or choose another --state-dir",
            )
        # 0710/0711: opened for traversal to a socket group by the agent (runners/backend/sockets.py).
        if stat.S_IMODE(st.st_mode) not in (0o700, 0o710, 0o711):
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return state_dir
