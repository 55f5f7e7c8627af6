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

from models.tables import Host
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


# -- 2, 5, 6. credential sources and env files: no link, no FIFO, no device, a cap -----------

def _stored(vigil: Vigil, host: str) -> tuple[list[str], dict[str, str]]:
    h = vigil.store.read(lambda s: s.get(Host, host))
    return json.loads(h.env_files), json.loads(h.credentials)


def _add(vigil: Vigil, what: str, path: Path, host: str = "w") -> subprocess.CompletedProcess[str]:
    """`host add` in a real process (a FIFO wedged it: pytest must not hang with it)."""
    opt = ["--credential", f"tok={path}"] if what == "credential" else ["--env-file", str(path)]
    return vigil.run("host", "add", host, "--build", str(HELLO), *opt, check=False,
                     subprocess=True, timeout=30)


def _failed_start(vigil: Vigil, host: str, *words: str) -> str:
    """A wake of `host` that the agent refuses to start: the reason in its status."""
    vigil.run("wake", host, check=False)
    wait_for(lambda: vigil.status(host).get("problem"), 20, what="the failed start in status")
    problem = str(vigil.status(host)["problem"])
    assert vigil.status(host)["generation"] is None, problem
    for w in words:
        assert w in problem, problem
    return problem


def _copied(vigil: Vigil) -> list[bytes]:
    """Every credential file the agent copied in, read as root."""
    root = vigil.state_dir / "credentials"
    return [p.read_bytes() for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.mark.parametrize("what", ["credential", "env-file"])
def test_a_link_is_refused_at_add(vigil: Vigil, short_tmp: Path, what: str) -> None:
    real = short_tmp / "real"
    real.write_text("A=1\n")
    (short_tmp / "link").symlink_to(real)
    line = _one_line(_add(vigil, what, short_tmp / "link"), str(short_tmp / "link"),
                     "symbolic link")
    assert "A=1" not in line and vigil.store.read(lambda s: s.get(Host, "w")) is None


def test_a_credential_swapped_for_a_link_is_not_followed(vigil: Vigil, short_tmp: Path) -> None:
    """The source lies in a directory others can write (said at add, in one line); after the
    add it is swapped for a link to a root-only file: the start is refused, nothing copied."""
    shared = short_tmp / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    src, shadow = shared / "token", short_tmp / "shadow"
    src.write_text("token-value\n")
    shadow.write_text("root:$6$hash-of-root\n")
    os.chmod(shadow, 0o600)
    cp = _add(vigil, "credential", src)
    assert cp.returncode == 0, cp.stderr
    warn = [ln for ln in cp.stderr.splitlines() if ln.startswith("vigil: warning: ")]
    assert len(warn) == 1 and str(shared) in warn[0] and "others can write" in warn[0], cp.stderr
    src.unlink()
    src.symlink_to(shadow)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    _failed_start(vigil, "w", str(src), "symbolic link")
    assert not any(b"hash-of-root" in data for data in _copied(vigil))
    vigil.stop_agent(agent)


@pytest.mark.parametrize("what", ["credential", "env-file"])
def test_a_fifo_is_refused_at_add_without_a_hang(vigil: Vigil, short_tmp: Path, what: str) -> None:
    os.mkfifo(short_tmp / "fifo")
    _one_line(_add(vigil, what, short_tmp / "fifo"), str(short_tmp / "fifo"), "FIFO")


@pytest.mark.parametrize("what", ["credential", "env-file"])
def test_a_device_is_refused_at_add(vigil: Vigil, what: str) -> None:
    """/dev/zero: the credential passed (its st_size is 0) and then filled the disk at each
    start; the env file was read until a MemoryError (here bounded by an address-space
    limit, so the box is not starved before the fix)."""
    opt = ["--credential", "tok=/dev/zero"] if what == "credential" else ["--env-file", "/dev/zero"]
    cp = subprocess.run([sys.executable, "-m", "runners.cli", "host", "add", "w", "--build",
                         str(HELLO), *opt], capture_output=True, text=True, env=vigil.env,
                        cwd=ROOT, timeout=60, preexec_fn=_at_most_2g)
    _one_line(cp, "/dev/zero", "a device, not a regular file")


def _at_most_2g() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def test_an_env_file_over_the_cap_is_refused_at_add(vigil: Vigil, short_tmp: Path) -> None:
    """An env file was read whole, however big (a credential had its 1 MiB cap already)."""
    big = short_tmp / "big"
    big.write_text("B=1\n" * 300_000)  # 1.2 MB, every line valid
    _one_line(_add(vigil, "env-file", big), str(big), "larger than 1048576 bytes")


def test_a_fifo_a_device_or_a_big_file_swapped_in_after_add_fails_the_start(
        vigil: Vigil, short_tmp: Path) -> None:
    """Each swapped in after `host add`: the start is refused with one line in status (a
    FIFO wedged the agent in `spawning`; a device node filled the disk; a big file was
    copied whole), nothing is copied, and the agent still stops at once."""
    cred, env_file = short_tmp / "token", short_tmp / "app.env"
    cred.write_text("token-value\n")
    env_file.write_text("A=1\n")
    vigil.add_host("c", HELLO, "--credential", f"tok={cred}")
    vigil.add_host("e", HELLO, "--env-file", str(env_file))
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    for path in (cred, env_file):
        path.unlink()
        os.mkfifo(path)
    _failed_start(vigil, "c", str(cred), "FIFO")
    _failed_start(vigil, "e", str(env_file), "FIFO")
    vigil.run("stop", "c", "--wait")
    cred.unlink()
    os.mknod(cred, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's own numbers
    _failed_start(vigil, "c", str(cred), "a device, not a regular file")
    vigil.run("stop", "c", "--wait")
    cred.unlink()
    cred.write_bytes(b"x" * (2 << 20))
    _failed_start(vigil, "c", str(cred), "1048576")
    assert _copied(vigil) == []
    vigil.run("stop", "c", "e", "--wait")
    vigil.run("agent", "stop", "--wait", "--timeout", "20")
    assert agent.wait(10) == 0


def test_host_set_changes_and_drops_credentials_and_env_files(vigil: Vigil, short_tmp: Path) -> None:
    """A bad credential or env file could not be taken back without `host rm`: `host set`
    replaces them (checked as `host add` checks them) and `--unset` drops them."""
    for name in ("one", "two"):
        (short_tmp / f"{name}.tok").write_text(f"{name}\n")
        (short_tmp / f"{name}.env").write_text(f"N={name}\n")
    vigil.add_host("w", HELLO, "--credential", f"tok={short_tmp / 'one.tok'}",
                   "--env-file", str(short_tmp / "one.env"))
    vigil.run("host", "set", "w", "--credential", f"key={short_tmp / 'two.tok'}",
              "--env-file", str(short_tmp / "two.env"))
    assert _stored(vigil, "w") == ([str(short_tmp / "two.env")], {"key": str(short_tmp / "two.tok")})
    cp = vigil.run("host", "set", "w", "--credential", "tok=/dev/zero", check=False)
    assert cp.returncode == 2 and "/dev/zero" in cp.stderr, cp.stderr
    assert _stored(vigil, "w")[1] == {"key": str(short_tmp / "two.tok")}  # nothing changed
    vigil.run("host", "set", "w", "--unset", "credential", "--unset", "env-file")
    assert _stored(vigil, "w") == ([], {})


def test_an_env_file_just_under_the_cap_is_read_at_once(vigil: Vigil, short_tmp: Path) -> None:
    """The parser copied the file's lines once per line: a valid 1 MB env file (250,000
    lines) held `host add` for minutes, and each start of its host as long."""
    f = short_tmp / "big.env"
    f.write_text("B=1\n" * 250_000)  # 1,000,000 bytes: under the cap
    cp = _add(vigil, "env-file", f)
    assert cp.returncode == 0, cp.stderr
