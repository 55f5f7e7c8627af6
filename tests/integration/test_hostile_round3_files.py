"""Issue 37, round three (items 1, 2, 3, 5, 6): hostile files. A planted `.vigil` link, a
credential or env file swapped for a link, a FIFO or a device, a bad env-file line that
holds a secret. Real processes, real files; each refusal is one line and changes nothing."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELLO, ROOT, Vigil, wait_for

pytestmark = pytest.mark.timeout(180)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A real `vigil` in `cwd` with no VIGIL_HOME: the state dir is the default one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIGIL_")}
    return subprocess.run([sys.executable, "-m", "runners.cli", *args], capture_output=True,
                          text=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=cwd, timeout=60)


def _one_line(cp: subprocess.CompletedProcess[str], *words: str) -> str:
    assert cp.returncode != 0, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vigil: error: "), cp.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    """Every path under `d` (and `d`) with its mode and size: what a refusal must not change."""
    out = {str(d): (d.stat().st_mode, 0)}
    for p in d.rglob("*"):
        st = p.lstat()
        out[str(p)] = (st.st_mode, st.st_size)
    return out


# -- 1. a planted .vigil link ----------------------------------------------------------------

def test_a_planted_state_dir_link_locks_nothing_down(short_tmp: Path) -> None:
    """`ln -s VICTIM PUB/.vigil` in a world-writable PUB: root in PUB/proj (the upward
    search finds the link) and root naming it with --state-dir are refused in one line; the
    victim keeps its modes and gets no file."""
    pub, victim = short_tmp / "pub", short_tmp / "victim"
    pub.mkdir()
    os.chmod(pub, 0o1777)
    victim.mkdir()
    os.chmod(victim, 0o755)
    (victim / "passwd").write_text("root:x:0:0\n")
    os.chmod(victim / "passwd", 0o644)
    (pub / ".vigil").symlink_to(victim)
    (pub / "proj").mkdir()
    before = _snapshot(victim)
    for args in (("db", "upgrade"), ("agent", "start"), ("status",)):
        _one_line(_cli(*args, cwd=pub / "proj"), str(pub / ".vigil"), "symbolic link")
    for args in (("db", "upgrade"), ("agent", "start")):
        _one_line(_cli("--state-dir", str(pub / ".vigil"), *args, cwd=short_tmp),
                  str(pub / ".vigil"), "symbolic link")
    assert _snapshot(victim) == before


def test_a_state_dir_found_under_a_dir_others_can_write_is_refused(short_tmp: Path) -> None:
    """A real `.vigil` directory, but in a directory any user can write (one could swap it
    for a link between the check and the use): the search refuses it and says how to name
    it; named with --state-dir it is used. The fallback `./.vigil` there is not created."""
    pub = short_tmp / "pub"
    pub.mkdir()
    os.chmod(pub, 0o777)
    line = _one_line(_cli("db", "upgrade", cwd=pub), str(pub), "others can write", "--state-dir")
    assert not (pub / ".vigil").exists(), line
    (pub / ".vigil").mkdir(mode=0o700)
    (pub / "sub").mkdir()
    before = _snapshot(pub / ".vigil")
    for args in (("db", "upgrade"), ("status",)):
        _one_line(_cli(*args, cwd=pub / "sub"), str(pub / ".vigil"), "others can write")
    assert _snapshot(pub / ".vigil") == before
    cp = _cli("--state-dir", str(pub / ".vigil"), "db", "upgrade", cwd=pub)
    assert cp.returncode == 0, cp.stderr
    assert stat.S_IMODE((pub / ".vigil").stat().st_mode) == 0o700


# -- 3. a bad env-file line is named by number, never shown ---------------------------------

SECRET = "Sup3rS3cret"
BAD_LINES = (f"DB_PASSWORD: {SECRET}\n", f"{SECRET}+x==\n")  # no `=`; not a name before it


@pytest.mark.parametrize("bad", BAD_LINES)
def test_a_bad_env_file_line_is_not_shown_at_add(vigil: Vigil, short_tmp: Path, bad: str) -> None:
    f = short_tmp / "app.env"
    f.write_text("LEVEL=info\n" + bad)
    cp = vigil.run("host", "add", "w", "--build", str(HELLO), "--env-file", str(f), check=False)
    assert cp.returncode == 2 and f"{f}:2" in cp.stderr, cp.stderr
    assert SECRET not in cp.stdout + cp.stderr, cp.stderr


def test_a_bad_env_file_line_is_not_shown_at_a_start(vigil: Vigil, short_tmp: Path) -> None:
    """The file goes bad after `host add`: the failed start's reason in status, events and
    the agent's log names file and line, and holds nothing of the line."""
    f = short_tmp / "app.env"
    f.write_text("LEVEL=info\n")
    vigil.add_host("w", HELLO, "--env-file", str(f))
    f.write_text("LEVEL=info\n" + BAD_LINES[0])
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w", check=False)
    wait_for(lambda: vigil.status("w").get("problem"), 20, what="the failed start in status")
    assert f"env file {f}:2:" in vigil.status("w")["problem"]
    for out in (json.dumps(vigil.status("w")), vigil.run("events", "w").stdout,
                vigil.run("status", "w").stdout, vigil.agent_log().decode()):
        assert SECRET not in out, out
    vigil.stop_agent(agent)
