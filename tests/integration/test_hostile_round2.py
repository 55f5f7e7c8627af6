"""Issue 20, round two: false outcomes and messages found by attacking a running agent (a
SIGSTOPped agent, a build deleted mid-rollout, a build replaced while it is staged, a full
disk, non-UTF-8 paths, leftovers of removed hosts). Real agent, real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from models.tables import Attempt, Generation
from runners.backend.health import get_status
from tests.conftest import HELLO, ROOT, Vigil, wait_for

pytestmark = pytest.mark.timeout(180)
GATED = Path(__file__).parents[1] / "multibox" / "gated.py"


def _newest(vigil: Vigil, host: str) -> Generation | None:
    return vigil.store.read(lambda s: s.execute(
        select(Generation).where(Generation.host == host).order_by(Generation.id.desc())
        .limit(1)).scalar_one_or_none())


def _attempt(vigil: Vigil, attempt_id: int) -> Attempt:
    return vigil.store.read(lambda s: s.get(Attempt, attempt_id))


def _answers(path: str) -> bool:
    try:
        return get_status(path, 1.0) < 500
    except (OSError, ValueError):
        return False


# -- 9. time the agent did not run is not counted against an app ----------------------------

def test_a_paused_agent_does_not_fail_a_good_deploy(vigil: Vigil, short_tmp: Path) -> None:
    """The agent is SIGSTOPped while it waits for a successor's health; the successor starts
    answering meanwhile and the pause outlasts the health timeout: after SIGCONT the deploy
    is done, not failed and held down."""
    gate = short_tmp / "gate"
    vigil.add_host("app", HELLO, "--env", f"GATE={gate}", "--env", f"THEN={HELLO}",
                   "--health-timeout", "2")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "app", "--wait")
    first = _newest(vigil, "app")
    assert first is not None
    out = vigil.run("deploy", "app", str(GATED)).stdout
    attempt_id = int(next(w for w in out.split() if w.startswith("#"))[1:])
    wait_for(lambda: (g := _newest(vigil, "app")) is not None and g.id != first.id and g.pid,
             20, what="the successor spawned")
    successor = _newest(vigil, "app")
    assert successor is not None and successor.socket
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        gate.touch()
        wait_for(lambda: _answers(str(successor.socket)), 20, what="the successor answering")
        wait_for(lambda: time.monotonic() - stopped > 2 + 1.5, 10, what="the health timeout passed")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    wait_for(lambda: _attempt(vigil, attempt_id).outcome is not None, 30, what="the attempt ended")
    a = _attempt(vigil, attempt_id)
    assert a.outcome.value == "done", (a.outcome, a.reason)
    assert vigil.status("app")["pid"] == successor.pid
    vigil.quiesce(20)
    vigil.check()


# -- 10. a rollout whose build cannot be read halts ------------------------------------------

def test_a_rollout_whose_build_is_deleted_halts_with_that_reason(vigil: Vigil,
                                                                 short_tmp: Path) -> None:
    """The staged build is deleted between wave 1 and wave 2: the rollout halts, naming the
    build that cannot be read, `rollout start --wait` exits non-zero, and no host is tried
    again and again (at most one attempt each)."""
    from models.states import Cause, RolloutOutcome
    from models.tables import Rollout
    from tests.integration.test_rollouts import HOSTS, build_variant, digest, fleet, started_id

    fleet(vigil)
    new = build_variant(short_tmp / "hello-next.py")
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "rollout", "start", str(new),
                          "--hosts", "web*", "--waves", "1,100%", "--pause", "3", "--wait",
                          "--timeout", "120"], env=vigil.env, cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: vigil.store.read(lambda s: s.execute(
            select(Rollout.settled)).scalar()) == 1, 60, what="wave 1 settled")
        shutil.rmtree(vigil.state_dir / "builds" / digest(new))
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    rid = started_id(out)
    r = vigil.store.read(lambda s: s.get(Rollout, rid))
    assert p.returncode == 1, out + err
    assert r.outcome is RolloutOutcome.halted, (r.outcome, r.reason)
    assert "cannot be read" in (r.reason or "") and digest(new)[:12] in (r.reason or ""), r.reason
    assert "cannot be read" in err, err
    counts = vigil.store.read(lambda s: [len(s.execute(select(Attempt.id).where(
        Attempt.host == h, Attempt.cause == Cause.rollout)).all()) for h in HOSTS])
    assert counts[0] == 1 and max(counts) <= 1, counts
    vigil.quiesce(30)
    cp = vigil.run("check", check=False)  # web1 runs the deleted build: that, and nothing else
    assert cp.returncode == 1 and cp.stdout.splitlines() == [
        line for line in cp.stdout.splitlines() if line.startswith("referenced_build: ")], cp.stdout


# -- 11. what is staged is what was hashed ----------------------------------------------------

def _digest_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_build_replaced_while_it_is_staged_is_named_by_what_was_copied(short_tmp: Path) -> None:
    """The source is swapped between two builds (atomic renames) as fast as it can be while
    it is staged again and again: every staged file holds the bytes its name says."""
    import threading

    from runners.backend.files import stage_build

    state = short_tmp / "state"
    state.mkdir(mode=0o700)
    src = short_tmp / "app.py"
    versions = []
    for tag in ("a", "b"):
        v = short_tmp / f"v{tag}.py"
        v.write_bytes(b"#!/bin/sh\n" + tag.encode() * (4 << 20))
        v.chmod(0o755)
        versions.append(v)
    os.link(versions[0], src)
    stop = threading.Event()

    def flip() -> None:
        i = 0
        while not stop.is_set():
            tmp = short_tmp / f"flip{i % 2}"
            tmp.unlink(missing_ok=True)  # a rename onto a link of the same file leaves it
            os.link(versions[i % 2], tmp)
            os.replace(tmp, src)
            i += 1

    t = threading.Thread(target=flip, daemon=True)
    t.start()
    try:
        staged = [stage_build(str(src), state) for _ in range(40)]
    finally:
        stop.set()
        t.join(10)
    wrong = {d[:12] for path, d in staged if _digest_of(Path(path)) != d}
    assert not wrong, f"staged under a digest its bytes do not have: {wrong}"
    assert {d for _, d in staged} <= {_digest_of(v) for v in versions}
    assert not [p for p in (state / "builds").rglob("*") if ".tmp" in p.name]


def test_a_staged_file_not_matching_its_name_is_replaced(short_tmp: Path) -> None:
    from runners.backend.files import stage_build

    state = short_tmp / "state"
    state.mkdir(mode=0o700)
    src = short_tmp / "app.py"
    src.write_bytes(b"#!/bin/sh\necho good\n")
    src.chmod(0o755)
    path, digest = stage_build(str(src), state)
    Path(path).write_bytes(b"#!/bin/sh\necho tampered\n")
    again, digest2 = stage_build(str(src), state)
    assert (again, digest2) == (path, digest)
    assert _digest_of(Path(path)) == digest
    assert os.access(path, os.X_OK)


# -- 20. non-UTF-8 paths and names ---------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ("host", "add", "x", "--build", "{bad_build}"),
    ("host", "add", "x", "--build", str(HELLO), "--cwd", "/tmp/\udcfe"),
    ("deploy", "hello", "{bad_build}"),
    ("wake", "\udcff"),
    ("stop", "\udcff"),
])
def test_non_utf8_arguments_are_one_line_and_change_nothing(vigil: Vigil, short_tmp: Path,
                                                            args: tuple[str, ...]) -> None:
    """A path or name that is not UTF-8 (argv as bytes, e.g. $'/tmp/\\xff.py'): one line
    naming it, exit 2, nothing staged or written, with the agent up (its socket path) and
    in a real process (the bytes as the kernel passes them)."""
    from tests.integration.test_cli_bad_input import dump, refused

    bad = os.fsencode(short_tmp) + b"/\xff.py"
    Path(os.fsdecode(bad)).write_bytes(HELLO.read_bytes())
    os.chmod(bad, 0o755)
    vigil.add_host("hello")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    ignore = frozenset({("agents", "heartbeat_at")})
    before = dump(vigil, ignore)
    staged = sorted(p.name for p in (vigil.state_dir / "builds").iterdir())
    argv = tuple(a.replace("{bad_build}", os.fsdecode(bad)) for a in args)
    line = refused(vigil.run(*argv, check=False, subprocess=True), "not valid UTF-8", "\\xf")
    assert "\udcff" not in line and "\udcfe" not in line
    assert dump(vigil, ignore) == before
    assert sorted(p.name for p in (vigil.state_dir / "builds").iterdir()) == staged
    assert agent.poll() is None


# -- 21. leftovers: control bytes, files of removed hosts and failed generations ---------------

def _worker_printing(short_tmp: Path, text: str) -> Path:
    build = short_tmp / "loud.sh"
    build.write_text(f"#!/bin/sh\nprintf '{text}'\nexec sleep 1000\n")
    build.chmod(0o755)
    return build


def test_logs_escape_an_apps_control_bytes_on_a_terminal_only(vigil: Vigil, short_tmp: Path) -> None:
    import pty

    vigil.add_host("w", _worker_printing(short_tmp, "\\033]0;pwned\\007\\033[2Jred\\r\\n"),
                   "--kind", "worker")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w", "--wait")
    wait_for(lambda: b"red" in b"".join(p.read_bytes() for p in (vigil.state_dir / "logs" / "w")
                                         .iterdir()), 20, what="the worker's output")
    piped = vigil.run("logs", "w", subprocess=True).stdout
    assert "\x1b]0;pwned\x07\x1b[2Jred" in piped, repr(piped)  # a pipe gets the bytes as written
    leader, follower = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "runners.cli", "logs", "w"], env=vigil.env,
                           cwd=ROOT, stdout=follower, stderr=subprocess.PIPE, timeout=60)
        os.close(follower)
        follower = -1
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the writer has gone
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
        if follower != -1:
            os.close(follower)
    assert p.returncode == 0, p.stderr
    assert b"\x1b" not in out and b"\x07" not in out, out
    assert b"\\x1b]0;pwned\\x07\\x1b[2Jred" in out, out


def test_the_agents_own_log_lines_escape_control_characters() -> None:
    import logging

    from runners.agent.agent_log import TEXT, TextFormatter

    record = logging.LogRecord("vigil.x", logging.WARNING, __file__, 1,
                               "notify status=%s", ("\x1b[2J\nts=forged level=INFO",), None)
    line = TextFormatter(TEXT).format(record)
    assert "\x1b" not in line and "\n" not in line, line
    assert "\\x1b[2J\\x0ats=forged" in line, line


def test_a_removed_host_leaves_no_files_and_its_name_starts_clean(vigil: Vigil,
                                                                  short_tmp: Path) -> None:
    """`host rm`: its run/ dir, canonical link and logs go with it; a host added again under
    the name shows none of the old one's output."""
    vigil.add_host("w", _worker_printing(short_tmp, "old output\\n"), "--kind", "worker")
    vigil.add_host("web")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w", "--wait")
    vigil.run("wake", "web", "--wait")
    wait_for(lambda: "old output" in vigil.run("logs", "w").stdout, 20, what="the worker's output")
    for host in ("w", "web"):
        vigil.run("stop", host, "--wait")
        vigil.quiesce(20)
        vigil.run("host", "rm", host)
    left = [p for p in (vigil.state_dir / "run").iterdir() if p.name.startswith(("w", "web"))]
    left += [p for p in (vigil.state_dir / "logs").iterdir() if p.name in ("w", "web")]
    assert not left, left
    vigil.add_host("w", _worker_printing(short_tmp, "new output\\n"), "--kind", "worker")
    cp = vigil.run("logs", "w")
    assert "old output" not in cp.stdout + cp.stderr, cp.stdout
    vigil.check()


def test_a_failed_generations_socket_file_goes_once_it_is_proven(vigil: Vigil) -> None:
    from tests.conftest import FIXTURES

    vigil.add_host("hd", FIXTURES / "bad_health.py", "--health-timeout", "1")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    cp = vigil.run("wake", "hd", "--wait", check=False)
    assert cp.returncode != 0, cp.stdout
    vigil.quiesce(20)
    g = _newest(vigil, "hd")
    assert g is not None and g.socket and g.state.value == "proven", g
    assert not os.path.exists(g.socket), f"{g.socket} left behind"
    vigil.check()
