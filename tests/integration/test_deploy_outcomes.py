"""Deploy outcomes through the real CLI and the real agent: each scenario ends with the
attempt row every deploy writes (outcome, reason, executed, mode, drain), its events, the
processes proven where they should be, and `vigil check` passing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from models.states import GenState, Mode, Outcome
from models.tables import Attempt, Event, Generation, Lease, Member, Stop
from runners.backend.cgroups import detect_cgroup_base
from tests.conftest import FIXTURES, HELLO, Vigil, pid_dead, wait_for

CGROUP = detect_cgroup_base("auto")


# -- helpers ---------------------------------------------------------------------------


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def variant(src: Path, dest: Path, note: str) -> Path:
    """A copy of `src` with one extra comment line: same behaviour, another digest."""
    dest.write_bytes(src.read_bytes() + f"# {note}\n".encode())
    dest.chmod(0o755)
    return dest


def get(sock_path: str | Path) -> str:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(str(sock_path))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    finally:
        s.close()
    return data.decode()


def serves(vigil: Vigil, host: str, pid: int, build: Path | None = None) -> None:
    reply = get(vigil.state_dir / "run" / f"{host}.sock")
    assert reply.startswith("HTTP/1.0 200"), reply
    assert f"pid={pid}" in reply, reply
    if build is not None:
        assert f"build={digest(build)[:12]}" in reply, reply


def attempts(vigil: Vigil, host: str = "hello") -> list[Attempt]:
    return vigil.store.read(lambda s: list(s.execute(
        select(Attempt).where(Attempt.host == host).order_by(Attempt.id)).scalars()))


def attempt(vigil: Vigil, attempt_id: int) -> Attempt:
    return vigil.store.read(lambda s: s.get(Attempt, attempt_id))


def gen(vigil: Vigil, gen_id: int) -> Generation:
    return vigil.store.read(lambda s: s.get(Generation, gen_id))


def gen_count(vigil: Vigil, host: str = "hello") -> int:
    return vigil.store.read(lambda s: s.execute(
        select(func.count()).select_from(Generation).where(Generation.host == host)).scalar_one())


def events(vigil: Vigil, kind: str, host: str = "hello") -> list[dict[str, Any]]:
    return vigil.store.read(lambda s: [
        {"generation": e.generation_id, **json.loads(e.detail)}
        for e in s.execute(select(Event).where(Event.host == host, Event.kind == kind)
                           .order_by(Event.id)).scalars()])


def members(vigil: Vigil, host: str = "hello") -> list[Member]:
    return vigil.store.read(lambda s: list(s.execute(
        select(Member).where(Member.host == host)).scalars()))


def queued_id(cp_stdout: str) -> int:
    """`attempt #N of HOST queued` -> N."""
    word = next(w for w in cp_stdout.split() if w.startswith("#"))
    return int(word[1:])


def awake(vigil: Vigil, build: Path = HELLO, *extra: str, host: str = "hello",
          settle: float | None = None) -> dict[str, Any]:
    """Add the host, start an agent, wake it; returns its status."""
    if settle is not None:
        vigil.env["VIGIL_SETTLE_SECONDS"] = str(settle)
    vigil.add_host(host, build, *extra)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", host, "--wait")
    st = vigil.status(host)
    assert st["state"] == "awake" and st["pid"], st
    return st


def ends_clean(vigil: Vigil) -> None:
    vigil.quiesce(20)
    vigil.check()
    agent = vigil.agents[-1]  # the one running now (earlier ones were stopped on purpose)
    assert agent.poll() is None, vigil.agent_log().decode()[-3000:]


def one_line_error(cp: Any) -> str:
    assert cp.returncode != 0, cp.stdout
    lines = [line for line in cp.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("vigil: error: "), cp.stderr
    return lines[0]


# -- overlap: done, failed, settle, deaf old generation ------------------------------------


@pytest.mark.backend("an overlap deploy end to end, over each store")
def test_good_overlap_deploy_switches_drains_and_records(vigil: Vigil, short_tmp: Path) -> None:
    old = awake(vigil)
    new_build = variant(HELLO, short_tmp / "hello.py", "v2")
    cp = vigil.run("deploy", "hello", str(new_build), "--wait")
    assert "done (mode overlap, executed true, drain" in cp.stdout, cp.stdout
    assert "switched" in cp.stdout  # the steps are shown as they happen

    (a,) = attempts(vigil)
    assert (a.outcome, a.executed, a.mode, a.effective_mode) == (Outcome.done, True, Mode.overlap,
                                                               Mode.overlap)
    assert a.reason == "switched and drained" and a.cause.value == "release"
    assert a.drain_seconds is not None and 0 <= a.drain_seconds < 10
    assert a.digest == digest(new_build) and a.retiring_id == old["generation"]
    (swapped,) = events(vigil, "swapped")
    assert swapped["generation"] == a.successor_id and swapped["mode"] == "overlap"
    assert swapped["retired"] == old["generation"]
    assert swapped["drain_seconds"] == pytest.approx(a.drain_seconds, abs=0.001)
    assert [e["generation"] for e in events(vigil, "switched")] == [a.successor_id]

    assert pid_dead(old["pid"])
    assert gen(vigil, old["generation"]).state is GenState.proven
    st = vigil.status("hello")
    assert st["generation"] == a.successor_id and st["pid"] != old["pid"]
    assert st["build_digest"] == digest(new_build) != old["build_digest"]
    assert st["state"] == "awake" and st["lease"] is not None
    serves(vigil, "hello", st["pid"], new_build)
    assert members(vigil) == [] and vigil.app_pids() == [st["pid"]]
    ends_clean(vigil)


def test_build_failing_health_fails_old_keeps_serving_and_retry_runs(vigil: Vigil) -> None:
    old = awake(vigil, HELLO, "--health-timeout", "1")
    cp = vigil.run("deploy", "hello", str(FIXTURES / "bad_health.py"), "--wait", check=False)
    assert cp.returncode != 0, cp.stdout
    assert "failed (mode overlap, executed true" in cp.stderr, cp.stderr

    (a,) = attempts(vigil)
    assert (a.outcome, a.executed, a.effective_mode) == (Outcome.failed, True, Mode.overlap)
    assert "health" in a.reason and "500" in a.reason, a.reason
    assert a.drain_seconds is None
    successor = gen(vigil, a.successor_id)
    wait_for(lambda: pid_dead(successor.pid), 15, what="failed successor to be ended")
    vigil.quiesce(15)
    assert gen(vigil, a.successor_id).state is GenState.proven
    (failed,) = events(vigil, "deploy_failed")
    assert failed["executed"] is True and failed["generation"] == a.successor_id
    assert events(vigil, "switched") == [] and events(vigil, "swapped") == []

    st = vigil.status("hello")
    assert (st["generation"], st["pid"], st["build_digest"]) == (old["generation"], old["pid"],
                                                                 old["build_digest"])
    serves(vigil, "hello", old["pid"], HELLO)
    assert len(attempts(vigil)) == 1  # held down: nothing retries it on its own
    ends_clean(vigil)

    cp = vigil.run("retry", "hello", "--wait", check=False)
    assert cp.returncode != 0 and "failed" in cp.stderr, cp.stdout + cp.stderr
    first, again = attempts(vigil)
    assert again.cause.value == "retry" and again.digest == a.digest
    assert (again.outcome, again.executed) == (Outcome.failed, True)
    assert again.successor_id is not None and again.successor_id != a.successor_id  # it ran
    wait_for(lambda: pid_dead(gen(vigil, again.successor_id).pid), 15, what="retried successor end")
    serves(vigil, "hello", old["pid"], HELLO)
    ends_clean(vigil)


def test_successor_exiting_during_canary_settle_fails(vigil: Vigil) -> None:
    old = awake(vigil, settle=2)
    cp = vigil.run("deploy", "hello", str(FIXTURES / "exit_after_health.py"), "--canary", "--wait",
                   check=False)
    assert cp.returncode != 0, cp.stdout
    (a,) = attempts(vigil)
    assert a.canary is True
    assert (a.outcome, a.executed) == (Outcome.failed, True), a.reason
    assert "settle" in a.reason, a.reason
    assert pid_dead(gen(vigil, a.successor_id).pid)
    st = vigil.status("hello")
    assert (st["generation"], st["pid"]) == (old["generation"], old["pid"])
    serves(vigil, "hello", old["pid"])
    ends_clean(vigil)


@pytest.mark.parametrize("containment", ["cgroup", "marker"], indirect=True)
def test_old_generation_deaf_to_sigterm_is_killed_after_drain_timeout(vigil: Vigil,
                                                                     containment: str) -> None:
    if containment == "cgroup" and CGROUP is None:
        pytest.skip("no delegated cgroup v2 with cgroup.kill on this box")
    old = awake(vigil, FIXTURES / "serve_ignore_term.py", "--drain-timeout", "1")
    assert "deaf pid=" in get(vigil.state_dir / "run" / "hello.sock")
    cp = vigil.run("deploy", "hello", str(HELLO), "--wait")
    assert "done (mode overlap" in cp.stdout, cp.stdout
    (a,) = attempts(vigil)
    assert (a.outcome, a.executed) == (Outcome.done, True)
    assert a.drain_seconds is not None and a.drain_seconds >= 1.0, a.drain_seconds
    (swapped,) = events(vigil, "swapped")
    assert swapped["drain_seconds"] >= 1.0
    assert pid_dead(old["pid"]), "the SIGTERM-deaf generation survived its drain"
    assert gen(vigil, old["generation"]).state is GenState.proven
    st = vigil.status("hello")
    serves(vigil, "hello", st["pid"], HELLO)
    assert vigil.app_pids() == [st["pid"]]
    ends_clean(vigil)


def test_old_generation_dying_during_canary_still_switches(vigil: Vigil, short_tmp: Path) -> None:
    """The old current crashes while the successor settles: the liveness sweep retires it
    (and queues a restart); the deploy must still switch to the healthy successor, not kill
    it and restart the host on the old build."""
    old = awake(vigil, settle=4)
    b = variant(HELLO, short_tmp / "b.py", "b")
    aid = queued_id(vigil.run("deploy", "hello", str(b), "--canary").stdout)
    wait_for(lambda: attempt(vigil, aid).step.value == "healthy", 15, what="attempt settling")
    os.kill(old["pid"], signal.SIGKILL)
    wait_for(lambda: events(vigil, "exited"), 10, what="the sweep to retire the dead current")
    wait_for(lambda: attempt(vigil, aid).outcome is not None, 20, what="attempt ended")
    a = attempt(vigil, aid)
    assert (a.outcome, a.executed) == (Outcome.done, True), (a.outcome, a.reason, a.last_error)
    assert attempt(vigil, aid).step.value == "ended" and a.retiring_id is None  # it found no current
    vigil.quiesce(20)
    st = vigil.status("hello")
    assert st["generation"] == a.successor_id and st["build_digest"] == digest(b), st
    assert gen_count(vigil) == 2  # the restart wake found the host awake: no third start
    assert gen(vigil, old["generation"]).state is GenState.proven
    serves(vigil, "hello", st["pid"], b)
    assert vigil.app_pids() == [st["pid"]]
    ends_clean(vigil)


# -- superseded, and a stop during a deploy --------------------------------------------------


def test_superseded_in_flight_attempt_is_abandoned_never_failed(vigil: Vigil, short_tmp: Path) -> None:
    old = awake(vigil, settle=3)
    b = variant(HELLO, short_tmp / "b.py", "b")
    c = variant(HELLO, short_tmp / "c.py", "c")
    first = queued_id(vigil.run("deploy", "hello", str(b), "--canary").stdout)
    wait_for(lambda: attempt(vigil, first).step.value == "healthy", 15, what="first attempt settling")
    second = queued_id(vigil.run("deploy", "hello", str(c)).stdout)
    wait_for(lambda: attempt(vigil, second).outcome is not None, 30, what="newer attempt ended")

    older, newer = attempt(vigil, first), attempt(vigil, second)
    assert older.outcome is Outcome.abandoned, (older.outcome, older.reason)
    assert "superseded" in older.reason and older.executed is True, older.reason
    assert newer.outcome is Outcome.done and newer.revision > older.revision, newer.reason
    assert events(vigil, "deploy_failed") == []
    assert pid_dead(gen(vigil, older.successor_id).pid) and pid_dead(old["pid"])
    st = vigil.status("hello")
    assert st["generation"] == newer.successor_id and st["build_digest"] == digest(c)
    serves(vigil, "hello", st["pid"], c)
    assert vigil.app_pids() == [st["pid"]]
    ends_clean(vigil)


@pytest.mark.backend("one deploy superseding another: guarded moves racing")
def test_back_to_back_deploys_older_abandoned_newer_done(vigil: Vigil, short_tmp: Path) -> None:
    awake(vigil, settle=3)
    b = variant(HELLO, short_tmp / "b.py", "b")
    c = variant(HELLO, short_tmp / "c.py", "c")
    first = queued_id(vigil.run("deploy", "hello", str(b), "--canary").stdout)
    second = queued_id(vigil.run("deploy", "hello", str(c)).stdout)
    wait_for(lambda: attempt(vigil, second).outcome is not None, 30, what="newer attempt ended")
    older, newer = attempt(vigil, first), attempt(vigil, second)
    assert older.outcome is Outcome.abandoned and "superseded" in older.reason, older.reason
    successor = None if older.successor_id is None else gen(vigil, older.successor_id)
    if successor is None:  # superseded before its intent: nothing of it ran
        assert older.executed is False
    elif successor.pid is not None:
        assert pid_dead(successor.pid)
    # else superseded before its pid was recorded: refused at the spawning commit, nothing
    # ran (executed false); refused at the pid's own commit, after the exec, it ran
    # (executed true: seen once in CI) and its failed start's proof ends it: ends_clean
    # below finds nothing of it left.
    assert newer.outcome is Outcome.done, newer.reason
    st = vigil.status("hello")
    serves(vigil, "hello", st["pid"], c)
    ends_clean(vigil)


def test_stop_during_canary_deploy_cancels_it_then_stops(vigil: Vigil, short_tmp: Path) -> None:
    old = awake(vigil, settle=3)
    b = variant(HELLO, short_tmp / "b.py", "b")
    aid = queued_id(vigil.run("deploy", "hello", str(b), "--canary").stdout)
    wait_for(lambda: attempt(vigil, aid).step.value == "healthy", 15, what="attempt settling")
    successor = gen(vigil, attempt(vigil, aid).successor_id)
    assert not pid_dead(successor.pid)
    vigil.run("stop", "hello", "--wait", timeout=60)

    a = attempt(vigil, aid)
    assert a.outcome is Outcome.cancelled, (a.outcome, a.reason)
    assert "stop" in a.reason and a.executed is True, a.reason
    assert events(vigil, "deploy_failed") == []
    assert pid_dead(successor.pid) and pid_dead(old["pid"])
    stops = vigil.store.read(lambda s: list(s.execute(select(Stop)).scalars()))
    assert [st.state.value for st in stops] == ["done"]
    st = vigil.status("hello")
    assert st["state"] == "asleep" and st["lease"] is None and st["generation"] is None, st
    assert st["build_digest"] == old["build_digest"]  # the cancelled build was never made current
    assert members(vigil) == []
    assert vigil.store.read(lambda s: s.get(Lease, "hello")) is None
    assert vigil.app_pids() == []
    ends_clean(vigil)


def stuck_in_readiness(vigil: Vigil, short_tmp: Path) -> tuple[dict[str, Any], Attempt]:
    """An awake host whose deploy's successor never listens, its health timeout 120 s: the
    attempt waits on its readiness (pid recorded, not healthy)."""
    old = awake(vigil, HELLO, "--health-timeout", "120")
    deaf = variant(FIXTURES / "no_socket.py", short_tmp / "deaf.py", "deaf")
    aid = queued_id(vigil.run("deploy", "hello", str(deaf)).stdout)
    wait_for(lambda: attempt(vigil, aid).step.value == "spawned", 30, what="successor spawned")
    return old, attempt(vigil, aid)


def test_stop_of_a_deploy_waiting_on_readiness_ends_it_before_the_health_timeout(
        vigil: Vigil, short_tmp: Path) -> None:
    """Before: the stop waited for the attempt, which waited out its whole health timeout
    (the gate was read at its next step only): `stop --wait` took 120 s here."""
    old, a = stuck_in_readiness(vigil, short_tmp)
    successor = gen(vigil, a.successor_id)
    vigil.run("stop", "hello", "--wait", timeout=60)  # well inside the 120 s health timeout
    a = attempt(vigil, a.id)
    assert a.outcome is Outcome.cancelled and "stop" in a.reason, (a.outcome, a.reason)
    assert pid_dead(successor.pid) and pid_dead(old["pid"])
    assert events(vigil, "deploy_failed") == []  # the build was never judged
    assert vigil.status("hello")["state"] == "asleep"
    ends_clean(vigil)


def test_stop_of_a_wake_waiting_on_readiness_ends_it_before_the_health_timeout(
        vigil: Vigil, short_tmp: Path) -> None:
    """The wake's sibling of the test above: a first start that never listens, its health
    timeout 120 s. Before: the stop was held on the wake until the timeout ran out (`stop
    --wait` took 120 s); now the wake ends at once, cancelled (no build was judged: no
    `wake_failed`), its process proven gone."""
    deaf = variant(FIXTURES / "no_socket.py", short_tmp / "deaf.py", "deaf")
    vigil.add_host("hello", deaf, "--health-timeout", "120")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "hello")
    pid = wait_for(lambda: vigil.store.read(lambda s: s.execute(
        select(Generation.pid).where(Generation.host == "hello", Generation.pid.is_not(None))
    ).scalar()), 30, what="the start's pid recorded")
    vigil.run("stop", "hello", "--wait", timeout=60)  # well inside the 120 s health timeout
    (cancelled,) = events(vigil, "wake_cancelled")
    assert "stop #" in cancelled["reason"] and "before it was ready" in cancelled["reason"]
    assert events(vigil, "wake_failed") == []
    assert pid_dead(pid)
    assert vigil.status("hello")["state"] == "asleep"
    ends_clean(vigil)


def test_a_newer_deploy_supersedes_one_waiting_on_readiness_at_once(
        vigil: Vigil, short_tmp: Path) -> None:
    old, a = stuck_in_readiness(vigil, short_tmp)
    good = variant(HELLO, short_tmp / "good.py", "good")
    newer = queued_id(vigil.run("deploy", "hello", str(good), "--wait", timeout=60).stdout)
    older = attempt(vigil, a.id)
    assert older.outcome is Outcome.abandoned and "superseded" in older.reason, older.reason
    assert attempt(vigil, newer).outcome is Outcome.done
    assert pid_dead(gen(vigil, older.successor_id).pid) and pid_dead(old["pid"])
    st = vigil.status("hello")
    serves(vigil, "hello", st["pid"], good)
    ends_clean(vigil)


# -- hold mode, workers ----------------------------------------------------------------------


def test_hold_deploy_stops_old_then_starts_new(vigil: Vigil, short_tmp: Path) -> None:
    old = awake(vigil)
    b = variant(HELLO, short_tmp / "b.py", "b")
    cp = vigil.run("deploy", "hello", str(b), "--mode", "hold", "--wait")
    assert "done (mode hold, executed true" in cp.stdout, cp.stdout
    (a,) = attempts(vigil)
    assert (a.outcome, a.executed, a.mode, a.effective_mode) == (Outcome.done, True, Mode.hold,
                                                               Mode.hold)
    assert a.drain_seconds is not None and a.retiring_id == old["generation"]
    old_gen, new_gen = gen(vigil, old["generation"]), gen(vigil, a.successor_id)
    assert old_gen.state is GenState.proven and new_gen.state is GenState.current
    assert old_gen.ended_at <= new_gen.created_at  # proven before the new one was started
    (swapped,) = events(vigil, "swapped")
    assert swapped["mode"] == "hold" and swapped["retired"] == old["generation"]
    assert pid_dead(old["pid"])
    serves(vigil, "hello", new_gen.pid, b)
    ends_clean(vigil)


def test_hold_deploy_of_failing_build_leaves_host_down(vigil: Vigil) -> None:
    old = awake(vigil, HELLO, "--health-timeout", "1")
    cp = vigil.run("deploy", "hello", str(FIXTURES / "bad_health.py"), "--mode", "hold", "--wait",
                   check=False)
    assert cp.returncode != 0 and "down (mode hold" in cp.stderr, cp.stdout + cp.stderr
    (a,) = attempts(vigil)
    assert (a.outcome, a.executed, a.effective_mode) == (Outcome.down, True, Mode.hold), a.reason
    assert "health" in a.reason
    assert len(events(vigil, "down")) == 1
    vigil.quiesce(20)
    assert pid_dead(old["pid"]) and pid_dead(gen(vigil, a.successor_id).pid)
    assert vigil.app_pids() == []
    st = vigil.status("hello")
    assert st["state"] == "down" and st["generation"] is None, st
    assert st["build_digest"] == old["build_digest"]
    assert not os.path.lexists(vigil.state_dir / "run" / "hello.sock")
    ends_clean(vigil)


def test_worker_deploy_in_overlap_mode_runs_as_hold(vigil: Vigil, short_tmp: Path) -> None:
    old = awake(vigil, FIXTURES / "worker.py", "--kind", "worker", host="w")
    w2 = variant(FIXTURES / "worker.py", short_tmp / "worker.py", "w2")
    cp = vigil.run("deploy", "w", str(w2), "--mode", "overlap", "--wait")
    assert "done (mode hold, executed true" in cp.stdout, cp.stdout
    (a,) = attempts(vigil, "w")
    assert (a.mode, a.effective_mode, a.outcome) == (Mode.overlap, Mode.hold, Outcome.done)
    (requested,) = events(vigil, "deploy_requested", "w")
    assert (requested["mode"], requested["effective_mode"]) == ("overlap", "hold")
    assert pid_dead(old["pid"])
    st = vigil.status("w")
    assert st["generation"] == a.successor_id and st["build_digest"] == digest(w2)
    assert st["socket"] is None
    # A worker is current once alive; its interpreter may still be starting through
    # pyenv's shim scripts (children carrying its marker) for a moment.
    wait_for(lambda: vigil.app_pids() == [st["pid"]], 10, what="only the new worker left")
    ends_clean(vigil)


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("tamper", ["modified", "symlink_out"])
def test_staged_build_tampered_between_staging_and_exec_abandons_unexecuted(
        vigil: Vigil, short_tmp: Path, tamper: str) -> None:
    old = awake(vigil)
    agent = vigil.agents[-1]
    vigil.stop_agent(agent)
    before = gen_count(vigil)
    b = variant(HELLO, short_tmp / "b.py", "b")
    aid = queued_id(vigil.run("deploy", "hello", str(b)).stdout)
    staged = vigil.state_dir / "builds" / digest(b) / "b.py"
    assert staged.exists()
    if tamper == "modified":
        with open(staged, "ab") as f:
            f.write(b"# tampered after staging\n")
        why = "digest"
    else:  # the very same bytes, but outside the staging root
        staged.unlink()
        staged.symlink_to(b)
        why = "outside the staging root"
    ready = vigil.ready_count()
    vigil.wait_ready_after(vigil.start_agent(), ready)
    wait_for(lambda: attempt(vigil, aid).outcome is not None, 20, what="attempt ended")

    a = attempt(vigil, aid)
    assert (a.outcome, a.executed) == (Outcome.abandoned, False), (a.outcome, a.reason)
    assert why in a.reason, a.reason
    assert a.successor_id is None and gen_count(vigil) == before  # nothing spawned
    assert events(vigil, "deploy_failed") == []
    st = vigil.status("hello")
    assert (st["generation"], st["pid"], st["build_digest"]) == (old["generation"], old["pid"],
                                                                 old["build_digest"])
    serves(vigil, "hello", old["pid"], HELLO)
    ends_clean(vigil)


def test_deploy_to_unknown_host_is_a_one_line_error(vigil: Vigil) -> None:
    cp = vigil.run("deploy", "nosuch", str(HELLO), check=False)
    line = one_line_error(cp)
    assert "nosuch" in line, line
    assert attempts(vigil, "nosuch") == []
    assert not (vigil.state_dir / "builds").exists()  # nothing staged for a refused deploy


def test_deploy_to_sleeping_host_sets_build_for_next_wake(vigil: Vigil, short_tmp: Path) -> None:
    vigil.add_host("hello", HELLO)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    b = variant(HELLO, short_tmp / "b.py", "b")
    cp = vigil.run("deploy", "hello", str(b), "--wait")
    assert "done (mode overlap, executed false" in cp.stdout, cp.stdout
    (a,) = attempts(vigil)
    assert (a.outcome, a.executed, a.successor_id) == (Outcome.done, False, None), a.reason
    assert "next wake" in a.reason, a.reason
    assert gen_count(vigil) == 0 and vigil.app_pids() == []
    st = vigil.status("hello")
    assert st["state"] == "asleep" and st["build_digest"] == digest(b) and st["lease"] is None
    ends_clean(vigil)
    vigil.run("wake", "hello", "--wait")
    st = vigil.status("hello")
    serves(vigil, "hello", st["pid"], b)
    ends_clean(vigil)


# -- gc ---------------------------------------------------------------------------------------


def test_gc_deletes_only_unreferenced_builds(vigil: Vigil, short_tmp: Path) -> None:
    awake(vigil)
    a_dir = vigil.state_dir / "builds" / digest(HELLO)
    b = variant(HELLO, short_tmp / "b.py", "b")
    c = variant(HELLO, short_tmp / "c.py", "c")
    vigil.run("deploy", "hello", str(b), "--wait")
    b_file = vigil.state_dir / "builds" / digest(b) / "b.py"
    c_file = vigil.state_dir / "builds" / digest(c) / "c.py"

    # A queued attempt's build is referenced even though nothing of it runs yet.
    vigil.stop_agent(vigil.agents[-1])
    aid = queued_id(vigil.run("deploy", "hello", str(c)).stdout)
    cp = vigil.run("gc")
    assert cp.stdout.startswith("1 build(s) deleted"), cp.stdout
    assert not a_dir.exists(), "the retired build was kept"
    assert b_file.exists() and c_file.exists(), "a referenced build was deleted"
    assert [e["build"] for e in events(vigil, "build_deleted", None)] == [digest(HELLO)[:12]]
    # Every invariant holds but one: the queued attempt waits for an agent.
    cp = vigil.run("check", "--json", check=False)
    assert [v["name"] for v in json.loads(cp.stdout)] == ["agent_alive"], cp.stdout

    ready = vigil.ready_count()
    vigil.wait_ready_after(vigil.start_agent(), ready)
    wait_for(lambda: attempt(vigil, aid).outcome is not None, 20, what="queued deploy ended")
    assert attempt(vigil, aid).outcome is Outcome.done, attempt(vigil, aid).reason
    serves(vigil, "hello", vigil.status("hello")["pid"], c)
    vigil.quiesce(15)
    cp = vigil.run("gc")
    assert cp.stdout.startswith("1 build(s) deleted"), cp.stdout
    assert not b_file.parent.exists() and c_file.exists()
    assert vigil.run("gc").stdout.startswith("0 build(s) deleted")
    ends_clean(vigil)


def test_gc_keeps_a_referenced_build_sharing_a_digest_with_a_deleted_one(vigil: Vigil,
                                                                         short_tmp: Path) -> None:
    """Two staged builds with the same bytes under different names share one digest dir:
    deleting the unreferenced one must not delete the referenced one's file."""
    awake(vigil)
    same = short_tmp / "same.py"
    shutil.copyfile(HELLO, same)
    same.chmod(0o755)
    vigil.run("deploy", "hello", str(same), "--wait")
    kept = vigil.state_dir / "builds" / digest(HELLO) / "same.py"
    assert kept.exists()
    cp = vigil.run("gc")
    assert cp.stdout.startswith("1 build(s) deleted"), cp.stdout
    assert kept.exists(), "gc deleted the current build's staged file"
    assert not (vigil.state_dir / "builds" / digest(HELLO) / "hello.py").exists()
    ends_clean(vigil)
    # ...and the host can still be restarted from it.
    vigil.run("stop", "hello", "--wait")
    vigil.run("wake", "hello", "--wait")
    serves(vigil, "hello", vigil.status("hello")["pid"], HELLO)
    ends_clean(vigil)
