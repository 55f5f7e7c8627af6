"""Files vigil reads on an operator's word but that others may be able to touch: a
credential's source, an env file, the directory the state dir is found in. Each is opened
without following a last-component link and without blocking (a FIFO would wedge the CLI
or the agent), must be a regular file, and is read up to a cap (a device such as
/dev/zero has no end). Every refusal is a ValueError of one line, the path first."""

from __future__ import annotations

import errno
import os
import stat

FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def read_capped(path: str, cap: int) -> bytes:
    """The whole of a regular file of at most `cap` bytes. Raises FileNotFoundError when
    it is missing, else ValueError saying why it is refused (a link, not a regular file,
    larger than `cap`, unreadable)."""
    try:
        fd = os.open(path, FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise ValueError(f"{path} is a symbolic link, which vigil does not follow for a "
                             "secret (it could be swapped to aim at another file)") from None
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)  # of what was opened: a swap after a check cannot slip through
        if not stat.S_ISREG(st.st_mode):
            kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
            raise ValueError(f"{path} is {kind}, not a regular file")
        os.set_blocking(fd, True)
        chunks, left = [], cap + 1  # one byte more than the cap says it is over
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        raise ValueError(f"{path} is larger than {cap} bytes, the most vigil reads of it")
    return data


def writable_by_others(path: str) -> str | None:
    """Who besides you and root may write in directory `path` (create, rename, replace
    its entries), said as `any user (mode 1777)`, or None when nobody else may."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return f"any user, mode {mode:04o}"
    if st.st_uid not in (me, 0):
        return f"its owner, uid {st.st_uid}"
    if mode & stat.S_IWGRP and _group_has_others(st.st_gid, me):
        return f"group {st.st_gid}, mode {mode:04o}"
    return None


def _group_has_others(gid: int, me: int) -> bool:
    """A group-writable directory is only yours when its group is (a private group)."""
    import grp
    import pwd

    try:
        members = set(grp.getgrgid(gid).gr_mem)
        mine = pwd.getpwuid(me).pw_name
    except KeyError:
        return True  # a group or user with no name: no telling who is in it
    if members - {mine}:
        return True
    return any(p.pw_gid == gid and p.pw_uid != me for p in pwd.getpwall())
