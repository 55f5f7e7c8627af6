"""Rollouts with real processes: six instances of hello under a client loop each, a real
agent, the real CLI (`vigil rollout ...`), a build that fails its health check on one host
only, the failure book, pause/resume/abort, supersession by a stop and a newer deploy, the
pause between waves across a kill -9, and bad input."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.states import Cause, Outcome, RolloutOutcome, RolloutState, TargetState
from models.tables import Attempt, Build, Event, HeldBuild, Rollout, RolloutTarget
from tests.conftest import HELLO, Vigil, wait_for
from tests.integration.test_cli_bad_input import dump, refused
from tests.integration.test_deploy_load import Sample, request
from tests.integration.test_operator import free_port, scrape, value

pytestmark = pytest.mark.timeout(300)

HOSTS = [f"web{i}" for i in range(1, 7)]
PACE = 0.03  # between one client's requests: load on every host, not a CPU hog


def build_variant(path: Path, flags: Path | None = None, tag: str = "next") -> Path:
    """hello with other bytes (another digest). With `flags`, it answers 500 on the host
    whose name has a file `fail-<host>` there (hello reads HELLO_FAIL_HEALTH at start)."""
    first, rest = HELLO.read_text().split("\n", 1)
    prelude = ""
    if flags is not None:
        prelude = (f"import os as _os\nif _os.path.exists(_os.path.join({str(flags)!r}, 'fail-' + "
                   "_os.environ.get('VIGIL_HOST', ''))):\n    _os.environ['HELLO_FAIL_HEALTH'] = '1'\n")
    path.write_text(f"{first}\n{prelude}{rest}# build {tag}\n")
    path.chmod(0o755)
    return path


def fleet(v: Vigil, names: list[str] = HOSTS, *agent_args: str) -> Any:
    for h in names:
        v.run("host", "add", h, "--build", str(HELLO), "--health-timeout", "5",
              "--drain-timeout", "5")
    agent = v.start_agent(None, *agent_args)
    v.wait_ready(agent)
    for h in names:
        v.run("wake", h)
    wait_for(lambda: all(v.status(h)["state"] == "awake" for h in names), 60, interval=0.2,
             what="every host awake")
    return agent


def digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def serving(v: Vigil, host: str) -> Sample:
    return request(str(v.state_dir / "run" / f"{host}.sock"))


def the_rollout(v: Vigil, rid: int) -> Rollout:
    return v.store.read(lambda s: s.get(Rollout, rid))


def targets(v: Vigil, rid: int) -> dict[str, RolloutTarget]:
    return {t.host: t for t in v.store.read(lambda s: s.execute(
        select(RolloutTarget).where(RolloutTarget.rollout_id == rid)).scalars().all())}


def events(v: Vigil, kind: str) -> list[dict[str, Any]]:
    rows = v.store.read(lambda s: s.execute(select(Event).where(Event.kind == kind)
                                            .order_by(Event.id)).scalars().all())
    return [{"id": e.id, "at": e.at, "host": e.host, **json.loads(e.detail)} for e in rows]


def rollout_attempts(v: Vigil, host: str) -> list[Attempt]:
    return v.store.read(lambda s: s.execute(select(Attempt).where(
        Attempt.host == host, Attempt.cause == Cause.rollout).order_by(Attempt.id)).scalars().all())


def started_id(out: str) -> int:
    return int(out.split("#", 1)[1].split(" ", 1)[0])


def test_six_instances_in_three_waves_under_load_fail_no_request(vigil: Vigil,
                                                                short_tmp: Path) -> None:
    port = free_port()
    agent = fleet(vigil, HOSTS, "--metrics-listen", f"127.0.0.1:{port}")
    before = {h: vigil.status(h)["pid"] for h in HOSTS}
    new = build_variant(short_tmp / "hello-next.py")
    samples: dict[str, list[Sample]] = {h: [] for h in HOSTS}
    done = threading.Event()

    def client(host: str) -> None:
        while not done.is_set():
            try:
                samples[host].append(serving(vigil, host))
            except BaseException as exc:  # never lose a failure to a dying thread
                samples[host].append(Sample(time.time(), time.time(), False, error=repr(exc)))
            time.sleep(PACE)

    threads = [threading.Thread(target=client, args=(h,), daemon=True) for h in HOSTS]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: all(samples[h] for h in HOSTS), 10, what="every client answered")
        cp = vigil.run("rollout", "start", str(new), "--hosts", "web*", "--waves", "1,50%,100%",
                       "--wait", "--timeout", "240", timeout=260)
    finally:
        time.sleep(0.5)  # a few more requests on the new generations
        done.set()
        for t in threads:
            t.join(10)
    print(cp.stdout)
    assert "done: 6 of 6 host(s) moved" in cp.stdout, cp.stdout + cp.stderr
    failures = [s for ss in samples.values() for s in ss if not s.ok]
    counts = {h: len(ss) for h, ss in samples.items()}
    print(f"requests per host {counts}, failed {len(failures)}")
    assert not failures, f"{len(failures)} failed requests, first: {failures[:5]}"
    assert all(n > 20 for n in counts.values()), counts

    rid = started_id(cp.stdout)
    r = the_rollout(vigil, rid)
    assert r.outcome is RolloutOutcome.done and r.wave_count == 3
    # The waves: 1, 2 and 3 hosts, in host order; each admitted after the one before settled.
    admitted, settled = events(vigil, "rollout_wave_admitted"), events(vigil, "rollout_wave_settled")
    assert [sorted(e["attempts"]) for e in admitted] == [["web1"], ["web2", "web3"],
                                                         ["web4", "web5", "web6"]]
    assert [e["wave"] for e in settled] == [1, 2, 3] and all(e["done"] for e in settled)
    for k in (1, 2):
        assert settled[k - 1]["id"] < admitted[k]["id"], f"wave {k + 1} began before {k} settled"
    # Each host moved once, serving the new build from a new process.
    new_digest = digest(new)[:12]
    for h in HOSTS:
        (a,) = rollout_attempts(vigil, h)
        assert a.outcome is Outcome.done and a.executed is True, (h, a.outcome, a.reason)
        st = vigil.status(h)
        assert st["build_digest"][:12] == new_digest and st["pid"] != before[h]
        assert serving(vigil, h).build == new_digest
    assert value(scrape(port), "vigil_rollouts", state="ended") == 1
    assert value(scrape(port), "vigil_rollouts_ended", outcome="done") == 1
    assert value(scrape(port), "vigil_rollouts", state="running") == 0
    status = json.loads(vigil.run("rollout", "status", str(rid), "--json").stdout)
    assert status["moved"] == 6 and [t["attempt"]["outcome"] for t in status["targets"]] == ["done"] * 6
    human = vigil.run("rollout", "status").stdout
    assert f"rollout #{rid}" in human and "6/6" in human and "ended done" in human
    assert f"#{rid}" in vigil.run("rollout", "list").stdout
    vigil.quiesce(30)
    vigil.check()
    assert agent.poll() is None


def test_a_build_failing_on_one_host_halts_holds_it_down_until_retry(vigil: Vigil,
                                                                     short_tmp: Path) -> None:
    """wave 2's second host fails health: halted there, wave 3 never starts, wave 1 keeps the
    build. The build is held down on that host: a new rollout skips it, naming it, and an
    explicit deploy says so, until `vigil retry`."""
    flags = short_tmp / "flags"
    flags.mkdir()
    (flags / "fail-web3").touch()
    fleet(vigil)
    before = {h: vigil.status(h)["pid"] for h in HOSTS}
    bad = build_variant(short_tmp / "hello-bad.py", flags)
    cp = vigil.run("rollout", "start", str(bad), "--hosts", "web*", "--waves", "1,50%,100%",
                   "--wait", "--timeout", "240", check=False, timeout=260)
    print(cp.stdout, cp.stderr)
    assert cp.returncode == 1 and "halted: host web3 failed" in cp.stderr, cp.stdout + cp.stderr
    rid = started_id(cp.stdout)
    r = the_rollout(vigil, rid)
    assert r.outcome is RolloutOutcome.halted and r.wave == 2
    assert r.reason is not None and r.reason.startswith("host web3 failed: attempt #")
    assert [e["wave"] for e in events(vigil, "rollout_wave_admitted")] == [1, 2]  # never 3
    t = targets(vigil, rid)
    assert [t[h].state for h in HOSTS] == [TargetState.done, TargetState.done, TargetState.failed,
                                          TargetState.skipped, TargetState.skipped,
                                          TargetState.skipped]
    bad_digest = digest(bad)[:12]
    for h in ("web1", "web2"):  # wave 1 (and wave 2's first host) keep the new build
        assert serving(vigil, h).build == bad_digest
    for h in HOSTS[2:]:  # web3 kept its old generation; wave 3 never touched its hosts
        assert vigil.status(h)["pid"] == before[h] and serving(vigil, h).ok
    assert [len(rollout_attempts(vigil, h)) for h in HOSTS] == [1, 1, 1, 0, 0, 0]
    held = vigil.store.read(lambda s: s.execute(select(HeldBuild)).scalars().all())
    assert [(x.host, x.digest[:12]) for x in held] == [("web3", bad_digest)]

    # A new rollout of the same build skips the held-down host, naming it.
    cp = vigil.run("rollout", "start", str(bad), "--hosts", "web*", "--waves", "100%", "--wait",
                   timeout=200)
    assert f"skipped web3: build {bad_digest} is held down on web3 since attempt #" in cp.stdout
    assert "`vigil retry web3` lifts it" in cp.stdout and "skipped web1: already on build" in cp.stdout
    assert "done: 3 of 6 host(s) moved, 3 skipped" in cp.stdout, cp.stdout
    for h in ("web4", "web5", "web6"):
        assert serving(vigil, h).build == bad_digest
    # An explicit deploy of it still runs, and says it was held down.
    cp = vigil.run("deploy", "web3", str(bad), "--wait", check=False, timeout=120)
    assert "is held down on web3" in cp.stdout and "deploying it as asked" in cp.stdout, cp.stdout
    assert cp.returncode != 0 and "failed" in cp.stderr  # still the build's own failure there
    # `vigil retry` lifts it: fixed on the host, the retry moves it.
    (flags / "fail-web3").unlink()
    cp = vigil.run("retry", "web3", "--wait", timeout=120)
    assert "done" in cp.stdout, cp.stdout
    assert serving(vigil, "web3").build == bad_digest
    assert not vigil.store.read(lambda s: s.execute(select(HeldBuild)).scalars().all())
    vigil.quiesce(30)
    vigil.check()


def test_auto_revert_puts_the_moved_hosts_back_on_the_old_build(vigil: Vigil,
                                                                short_tmp: Path) -> None:
    flags = short_tmp / "flags"
    flags.mkdir()
    (flags / "fail-web3").touch()
    fleet(vigil)
    old_digest = digest(HELLO)[:12]
    untouched = {h: vigil.status(h)["pid"] for h in HOSTS[3:]}
    bad = build_variant(short_tmp / "hello-bad.py", flags)
    cp = vigil.run("rollout", "start", str(bad), "--hosts", "web*", "--waves", "1,50%,100%",
                   "--auto-revert", "--wait", "--timeout", "240", check=False, timeout=260)
    print(cp.stdout, cp.stderr)
    assert cp.returncode == 1 and "reverted: host web3 failed" in cp.stderr, cp.stdout + cp.stderr
    rid = started_id(cp.stdout)
    r = the_rollout(vigil, rid)
    assert r.outcome is RolloutOutcome.reverted and "2 host(s) reverted" in (r.reason or "")
    t = targets(vigil, rid)
    assert (t["web1"].state, t["web2"].state, t["web3"].state) == (
        TargetState.reverted, TargetState.reverted, TargetState.failed)
    for h in HOSTS:  # every host on the old build and serving
        answer = serving(vigil, h)
        assert answer.ok and answer.build == old_digest, (h, answer)
    old_id = vigil.store.read(lambda s: s.execute(select(Build.id).where(
        Build.digest == digest(HELLO))).scalar_one())
    for h in ("web1", "web2"):  # one attempt there, one back
        forward, back = rollout_attempts(vigil, h)
        assert forward.outcome is back.outcome is Outcome.done
        assert (forward.build_id, back.build_id) == (r.build_id, old_id)
    assert {h: vigil.status(h)["pid"] for h in HOSTS[3:]} == untouched
    assert [e["wave"] for e in events(vigil, "rollout_wave_admitted")] == [1, 2]
    vigil.quiesce(30)
    vigil.check()


def test_pause_resume_abort_and_supersession(vigil: Vigil, short_tmp: Path) -> None:
    """--pause is a due time on the row (a kill -9 between waves does not shorten it); pause
    and resume; a stop and a newer deploy take their hosts from the rollout (abandoned, not
    failed); abort ends it with nothing reverted."""
    names = HOSTS[:5]
    vigil.env["VIGIL_SETTLE_SECONDS"] = "4"  # the canary rollout below stays in flight that long
    agent = fleet(vigil, names)
    new = build_variant(short_tmp / "hello-next.py")
    other = build_variant(short_tmp / "hello-other.py", tag="other")
    out = vigil.run("rollout", "start", str(new), "--hosts", "web*", "--waves", "1,2,4",
                    "--pause", "4").stdout
    rid = started_id(out)
    wait_for(lambda: the_rollout(vigil, rid).settled == 1, 60, what="wave 1 settled")
    due = the_rollout(vigil, rid).wave_due_at
    assert due is not None
    agent.send_signal(signal.SIGKILL)  # mid-pause: the due time is a row, not a timer
    agent.wait(10)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    wait_for(lambda: the_rollout(vigil, rid).wave == 2, 60, what="wave 2 admitted")
    admitted = events(vigil, "rollout_wave_admitted")
    assert admitted[1]["at"] >= due, (admitted[1]["at"], due)
    # While wave 2 (web2) runs: pause (it settles, no wave 3), a stop of web4 (wave 3), a
    # newer deploy of web5 (wave 4).
    assert "paused" in vigil.run("rollout", "pause", str(rid)).stdout
    wait_for(lambda: the_rollout(vigil, rid).settled == 2, 60, what="wave 2 settled")
    vigil.run("stop", "web4", "--wait")
    vigil.run("deploy", "web5", str(other), "--wait", timeout=120)
    time.sleep(5)  # well past the pause: a paused rollout admits nothing
    assert the_rollout(vigil, rid).wave == 2 and the_rollout(vigil, rid).state is RolloutState.paused
    assert "resumed" in vigil.run("rollout", "resume", str(rid)).stdout
    wait_for(lambda: the_rollout(vigil, rid).settled == 3, 60, what="wave 3 settled")
    t = targets(vigil, rid)
    assert t["web3"].state is TargetState.done
    assert t["web4"].state is TargetState.abandoned and "stopped (stop #" in (t["web4"].reason or "")
    assert t["web5"].state is TargetState.pending  # its wave (4) waits out the pause
    assert "aborting" in vigil.run("rollout", "abort", str(rid)).stdout
    wait_for(lambda: the_rollout(vigil, rid).state is RolloutState.ended, 60, what="aborted")
    r = the_rollout(vigil, rid)
    assert r.outcome is RolloutOutcome.aborted
    t = targets(vigil, rid)
    assert t["web5"].state is TargetState.skipped
    other_digest = digest(other)[:12]
    assert serving(vigil, "web5").build == other_digest  # the operator's deploy stands
    refused(vigil.run("rollout", "abort", str(rid), check=False), "already ended")

    # A newer deploy supersedes a target whose wave is in flight (abandoned, never failed).
    out = vigil.run("rollout", "start", str(other), "--host", "web1", "--host", "web2",
                    "--waves", "100%", "--canary").stdout
    rid2 = started_id(out)
    wait_for(lambda: the_rollout(vigil, rid2).wave == 1, 30, what="the wave admitted")
    vigil.run("deploy", "web2", str(new), "--wait", timeout=120)
    wait_for(lambda: the_rollout(vigil, rid2).state is RolloutState.ended, 90, what="it ended")
    r = the_rollout(vigil, rid2)
    t = targets(vigil, rid2)
    assert r.outcome is RolloutOutcome.done, r.reason
    assert t["web1"].state is TargetState.done
    assert t["web2"].state is TargetState.abandoned and "superseded by attempt #" in (t["web2"].reason or "")
    assert serving(vigil, "web2").build == digest(new)[:12]
    assert not vigil.store.read(lambda s: s.execute(select(HeldBuild)).scalars().all())
    vigil.quiesce(30)
    vigil.check()


@pytest.mark.parametrize("args,words", [
    (("--hosts", "web*", "--waves", "0"), ("--waves '0'", "--waves 1,25%,100%")),
    (("--hosts", "web*", "--waves", "50%,1,"), ("empty wave",)),
    (("--hosts", "web*", "--waves", "150%"), ("percentage",)),
    (("--hosts", "web*", "--waves", "2,1"), ("cumulative",)),
    (("--hosts", "db*"), ("--hosts 'db*' matches no host", "vigil host list")),
    (("--host", "nope"), ("no host named 'nope'",)),
    ((), ("a rollout needs hosts", "--hosts GLOB")),
    (("--hosts", "web*", "--pause", "inf"), ("--pause",)),
    (("--hosts", "web*", "--max-failures", "-1"), ("--max-failures",)),
])
def test_bad_input_is_one_line_and_changes_nothing(vigil: Vigil, short_tmp: Path,
                                                   args: tuple[str, ...], words: tuple[str, ...]) -> None:
    for h in ("web1", "web2"):
        vigil.add_host(h)
    new = build_variant(short_tmp / "hello-next.py")
    before = dump(vigil)
    staged = sorted((vigil.state_dir / "builds").rglob("*"))
    cp = vigil.run("rollout", "start", str(new), *args, check=False, subprocess=True)
    if "--max-failures" in args:  # click's own refusal: a usage line, exit 2
        assert cp.returncode == 2 and "--max-failures" in cp.stderr, cp.stderr
    else:
        refused(cp, *words)
    assert dump(vigil) == before
    assert sorted((vigil.state_dir / "builds").rglob("*")) == staged  # nothing staged either


def test_status_pause_resume_abort_of_unknown_rollouts(vigil: Vigil) -> None:
    refused(vigil.run("rollout", "status", check=False), "no rollout yet")
    for cmd in ("status", "pause", "resume", "abort"):
        cp = vigil.run("rollout", cmd, "7", check=False)
        refused(cp, "no rollout #7", "vigil rollout list")
        assert cp.returncode == 3
    assert "id" in vigil.run("rollout", "list").stdout
    assert json.loads(vigil.run("rollout", "list", "--json").stdout) == []


def test_gc_keeps_an_open_rollouts_builds(vigil: Vigil, short_tmp: Path) -> None:
    vigil.add_host("web1")
    new = build_variant(short_tmp / "hello-next.py")
    out = vigil.run("rollout", "start", str(new), "--host", "web1").stdout  # no agent: stays open
    rid = started_id(out)
    vigil.run("gc")
    path = vigil.store.read(lambda s: s.get(Build, the_rollout(vigil, rid).build_id)).path
    assert Path(path).exists()
    assert "rollout" in {o["kind"] for o in vigil.obligations()}
    assert f"rollout #{rid}" in {o["host"] for o in vigil.obligations()}


def test_a_held_down_build_is_not_converged_onto_until_retry(vigil: Vigil, short_tmp: Path) -> None:
    """The failure book and workers: a build that failed on a worker is not put back by a
    converge (its drift is noted, nothing is replaced) until `vigil retry` lifts it."""
    from tests.conftest import FIXTURES

    flag = short_tmp / "fail-now"
    flag.touch()
    bad = short_tmp / "worker-b.py"
    first, rest = (FIXTURES / "worker.py").read_text().split("\n", 1)
    bad.write_text(f"{first}\nimport os, sys, time\nif os.path.exists({str(flag)!r}):\n"
                   f"    time.sleep(0.3)\n    sys.exit(3)\n{rest}")
    bad.chmod(0o755)
    vigil.env["VIGIL_SETTLE_SECONDS"] = "2"  # the canary below exits inside its settle
    vigil.add_host("w", FIXTURES / "worker.py", "--kind", "worker", "--converge-grace", "1")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w", "--wait")
    cp = vigil.run("deploy", "w", str(bad), "--canary", "--wait", check=False, timeout=120)
    assert cp.returncode != 0 and "down" in cp.stderr, cp.stdout + cp.stderr
    held = vigil.store.read(lambda s: s.execute(select(HeldBuild)).scalars().all())
    assert [(h.host, h.digest) for h in held] == [("w", digest(bad))]
    vigil.run("wake", "w", "--wait")  # back up on its build before
    flag.unlink()  # it would run now: only the book keeps it off
    old_gen = vigil.status("w")["generation"]
    vigil.run("deploy", "w", str(bad), "--converge")
    wait_for(lambda: events(vigil, "drift"), 30, what="the drift noted")
    time.sleep(4)  # four grace periods, a sweep a second
    assert not events(vigil, "converging")
    assert vigil.status("w")["generation"] == old_gen
    vigil.run("retry", "w", "--wait", timeout=120)
    st = vigil.status("w")
    assert st["build_digest"] == digest(bad) and st["generation"] != old_gen
    vigil.quiesce(30)
    vigil.check()
