"""Socket access on a real directory tree and real unix sockets: one group gets 0710
traversal, two groups make the shared dirs 0711, a symlink planted as a socket is never
followed, and the agent's start closes everything again when no group is in play."""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path

import pytest

from runners.backend.sockets import SocketAccess, parse_mode

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chgrp to another group needs root")

G1, G2 = "www-data", "nogroup"


def mode_gid(p: Path) -> tuple[int, int]:
    st = os.lstat(p)
    return stat.S_IMODE(st.st_mode), st.st_gid


def test_groups_modes_and_closing_again(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "vigil.db").touch(mode=0o644)
    g1, g2 = grp.getgrnam(G1).gr_gid, grp.getgrnam(G2).gr_gid
    access = SocketAccess(state, group=G1)
    access.settle(any_host_group=False)
    assert mode_gid(state) == (0o710, g1) and mode_gid(state / "run") == (0o710, g1)
    assert stat.S_IMODE(os.stat(state / "vigil.db").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state / "logs").st_mode) == 0o700

    a = state / "run" / "a"
    access.prepare_dir(str(a), None, None)  # the agent-wide group
    assert mode_gid(a) == (0o710, g1)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(a / "g1.sock"))
        access.grant(str(a / "g1.sock"), None, parse_mode("0660"))
        assert mode_gid(a / "g1.sock") == (0o660, g1)

    b = state / "run" / "b"
    access.prepare_dir(str(b), G2, None)  # a host with a group of its own
    assert mode_gid(b) == (0o710, g2)
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o711  # both groups must pass

    os.symlink(state / "vigil.db", b / "g2.sock")  # never chmod what a link points at
    with pytest.raises(OSError, match="not a unix socket"):
        access.grant(str(b / "g2.sock"), G2, None)
    assert stat.S_IMODE(os.stat(state / "vigil.db").st_mode) == 0o600

    SocketAccess(state).settle(any_host_group=False)  # no group left: private again
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state / "run").st_mode) == 0o700


@pytest.mark.parametrize(("text", "why"), [("600", "read and write"), ("0640", "read and write"),
                                           ("rw", "not an octal"), ("01660", "between")])
def test_bad_modes(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_mode(text)
