"""Workers through the real CLI and the real agent: the crash loop's backoff (measured from
event rows), recycling onto the captured build while a newer one is live, converging under
a budget, a restart coalescing with a queued release, one-shot runs, refused builds."""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.states import GenState, Outcome, WakeState
from models.tables import Attempt, Build, Event, Generation, Host, Wake
from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for

pytestmark = pytest.mark.timeout(120)

JOB = FIXTURES / "job.py"  # runs argv[1] seconds, exits argv[2]
WORKER = FIXTURES / "worker.py"  # runs until SIGTERM


def variant(src: Path, dest: Path, note: str) -> Path:
    """Same behaviour, another digest."""
    dest.write_bytes(src.read_bytes() + f"# {note}\n".encode())
    dest.chmod(0o755)
    return dest


def events(v: Vigil, kind: str, host: str) -> list[tuple[datetime, dict[str, Any]]]:
    rows = v.store.read(lambda s: s.execute(select(Event).where(
        Event.kind == kind, Event.host == host).order_by(Event.id)).scalars().all())
    return [(e.at, json.loads(e.detail)) for e in rows]


def gens(v: Vigil, host: str) -> list[Generation]:
    return v.store.read(lambda s: s.execute(select(Generation).where(
        Generation.host == host).order_by(Generation.id)).scalars().all())


def build_id(v: Vigil, path: Path) -> int:
    return v.store.read(lambda s: s.execute(select(Build.id).where(
        Build.source == str(path.absolute()))).scalar_one())


def agent(v: Vigil, *extra: str) -> None:
    p = v.start_agent(None, "--sweep-interval", "0.2", *extra)
    v.wait_ready(p)


def stop_all(v: Vigil, *hosts: str) -> None:
    for h in hosts:
        v.run("stop", h, "--wait", "--timeout", "60")
    v.quiesce(30)
    v.check()
    assert v.app_pids() == []


def near(delay: float, base: float) -> bool:
    """A restart delay drawn within ±20 % of the policy's `base` (rounded to the ms)."""
    return base * 0.8 - 0.001 <= delay <= base * 1.2 + 0.001


def test_crash_loop_backs_off_from_the_floor_to_the_cap(vigil: Vigil) -> None:
    vigil.add_host("w", JOB, "--kind", "worker", "--arg", "0.2", "--arg", "3",
                   "--restart-floor", "0.4", "--restart-cap", "1.6")
    agent(vigil)
    vigil.run("wake", "w")
    # While a restart waits out its backoff it is an open obligation (a `wake` row due later).
    wait_for(lambda: [o for o in vigil.obligations() if o["kind"] == "wake" and o["host"] == "w"
                      and o["next_attempt_at"] > o["since"]], 30, what="a deferred restart")
    wait_for(lambda: len(events(vigil, "restart_scheduled", "w")) >= 5, 60, what="five restarts")
    scheduled = events(vigil, "restart_scheduled", "w")[:5]
    # Each delay within ±20 % of the policy's (the jitter: no two hosts restart in lockstep).
    assert all(near(d["delay"], base) for (_, d), base in zip(scheduled, [0.4, 0.8, 1.6, 1.6, 1.6],
                                                                strict=True)), scheduled
    assert [d["streak"] for _, d in scheduled] == [1, 2, 3, 4, 5]
    assert all(d["reason"] == "exited 3" for _, d in scheduled)
    # Measured: from each restart's scheduling to the next start (`woke`) of the worker.
    woke = [at for at, _ in events(vigil, "woke", "w")]
    waits = []
    for at, d in scheduled[:4]:
        started = min(t for t in woke if t > at)
        waits.append((started - at).total_seconds())
        assert d["delay"] - 0.01 <= waits[-1] <= d["delay"] + 4.0, (d, waits)
    print("backoff waits measured:", [round(x, 3) for x in waits])
    # Every start ran the captured build: the host's only one.
    assert {g.build_id for g in gens(vigil, "w")} == {build_id(vigil, JOB)}
    stop_all(vigil, "w")


def test_recycles_and_restarts_onto_the_captured_build_while_a_newer_one_is_live(
        vigil: Vigil, short_tmp: Path) -> None:
    vigil.add_host("w", WORKER, "--kind", "worker", "--max-run", "2", "--converge-grace", "600",
                   "--restart-floor", "2")
    agent(vigil)
    vigil.run("wake", "w", "--wait")
    first = vigil.status("w")
    old, new = build_id(vigil, WORKER), None
    newer = variant(WORKER, short_tmp / "worker.py", "newer")
    vigil.run("deploy", "w", str(newer), "--converge")
    new = build_id(vigil, newer)
    wait_for(lambda: events(vigil, "recycling", "w"), 30, what="a max-run recycle")
    wait_for(lambda: vigil.status("w")["generation"] not in (None, first["generation"]), 30,
             what="the recycled worker")
    st = vigil.status("w")
    assert (st["build_id"], st["live_build_id"]) == (old, new), st
    assert pid_dead(first["pid"])
    # A crash restarts the captured build too; while it waits, gc keeps that build.
    os.kill(st["pid"], signal.SIGKILL)
    wait_for(lambda: events(vigil, "restart_scheduled", "w"), 30, what="the restart")
    wait_for(lambda: all(g.state in (GenState.proven,) for g in gens(vigil, "w")), 30,
             what="the crashed generation proven")
    (_, d), = events(vigil, "restart_scheduled", "w")
    assert d["build_id"] == old
    vigil.run("gc")
    old_path = vigil.store.read(lambda s: s.get(Build, old))
    assert old_path.deleted_at is None and os.path.exists(old_path.path)
    wait_for(lambda: vigil.status("w")["generation"] is not None, 30, what="the restart")
    assert vigil.status("w")["build_id"] == old
    stop_all(vigil, "w")


def test_converge_after_grace_one_per_sweep(vigil: Vigil, short_tmp: Path) -> None:
    names = ["c1", "c2", "c3"]
    for n in names:
        vigil.add_host(n, WORKER, "--kind", "worker", "--converge-grace", "1")
    agent(vigil, "--converge-budget", "1")
    for n in names:
        vigil.run("wake", n)
    for n in names:
        wait_for(lambda n=n: vigil.status(n)["state"] == "awake", 30, what=f"{n} awake")
    newer = variant(WORKER, short_tmp / "worker.py", "newer")
    for n in names:
        vigil.run("deploy", n, str(newer), "--converge")
    new = build_id(vigil, newer)
    wait_for(lambda: all(vigil.status(n)["build_id"] == new for n in names), 60,
             what="all three converged")
    converges = sorted((d["sweep"], at, n) for n in names for at, d in events(vigil, "converging", n))
    assert len(converges) == 3, converges
    sweeps = [c[0] for c in converges]
    assert len(set(sweeps)) == 3, f"more than one converge in a sweep: {converges}"
    for n in names:
        ((drift_at, _),), ((conv_at, _),) = events(vigil, "drift", n), events(vigil, "converging", n)
        assert (conv_at - drift_at).total_seconds() >= 1.0 - 0.01, n
    print("converge sweeps:", sweeps, "at", [c[1].isoformat() for c in converges])
    stop_all(vigil, *names)


def test_a_restart_coalesces_with_a_queued_release(vigil: Vigil, short_tmp: Path) -> None:
    vigil.add_host("w", JOB, "--kind", "worker", "--arg", "0.3", "--arg", "1",
                   "--restart-floor", "30")
    agent(vigil)
    vigil.run("wake", "w")
    wait_for(lambda: events(vigil, "restart_scheduled", "w"), 30, what="the crash's restart")
    release = variant(WORKER, short_tmp / "worker.py", "release")
    vigil.run("deploy", "w", str(release), "--wait", "--timeout", "60")
    (a,) = vigil.store.read(lambda s: s.execute(select(Attempt)).scalars().all())
    assert a.outcome is Outcome.done
    wakes = vigil.store.read(lambda s: s.execute(select(Wake).order_by(Wake.id)).scalars().all())
    restart = [w for w in wakes if w.cause == "restart"]
    assert len(restart) == 1 and restart[0].state is WakeState.cancelled, restart
    assert f"attempt #{a.id}" in (restart[0].reason or "")
    wait_for(lambda: vigil.status("w")["state"] == "awake", 30, what="the released build")
    # One spawn after the crash, onto the released build.
    g = gens(vigil, "w")
    assert len(g) == 2 and g[1].build_id == build_id(vigil, release), [(x.id, x.build_id) for x in g]
    stop_all(vigil, "w")


def test_one_shot_runs_once(vigil: Vigil, short_tmp: Path) -> None:
    vigil.env["VIGIL_SETTLE_SECONDS"] = "5"
    vigil.add_host("job", JOB, "--kind", "worker", "--one-shot", "--arg", "0.2", "--arg", "0")
    agent(vigil)
    good = variant(JOB, short_tmp / "good.py", "good")
    vigil.run("deploy", "job", str(good), "--wait", "--timeout", "60")
    a = vigil.store.read(lambda s: s.execute(select(Attempt)).scalar_one())
    assert (a.outcome, a.clean_exit, a.executed) == (Outcome.done, True, True), a.reason
    b = vigil.store.read(lambda s: s.get(Build, a.build_id))
    assert b.good_at is not None
    vigil.quiesce(30)
    assert vigil.status("job")["generation"] is None and vigil.app_pids() == []
    vigil.check()

    bad = short_tmp / "bad.py"
    bad.write_text("#!/usr/bin/env python3\nimport sys\nsys.exit(3)\n")
    bad.chmod(0o755)
    cp = vigil.run("deploy", "job", str(bad), "--wait", "--timeout", "60", check=False)
    assert cp.returncode != 0 and "failed" in cp.stderr and "status 3" in cp.stderr, cp.stderr
    vigil.quiesce(30)
    bad_build = vigil.store.read(lambda s: s.execute(select(Build).where(
        Build.source == str(bad))).scalar_one())
    assert bad_build.good_at is None
    # No respawn: nothing queued, nothing running, and the host keeps its good build.
    assert not [w for w in vigil.store.read(lambda s: s.execute(select(Wake)).scalars().all())]
    assert vigil.store.read(lambda s: s.get(Host, "job")).build_id == a.build_id

    # A wake runs it once as well.
    vigil.run("wake", "job", "--wait", "--timeout", "60")
    assert events(vigil, "clean_exit", "job")[-1][1].get("wake") is not None
    vigil.quiesce(30)
    assert vigil.app_pids() == []
    vigil.check()


def test_a_bad_staged_build_is_refused_until_fixed(vigil: Vigil) -> None:
    vigil.add_host("w", WORKER, "--kind", "worker")
    staged = Path(vigil.store.read(lambda s: s.get(Build, s.get(Host, "w").build_id)).path)
    agent(vigil)
    for spoil, fix, says in [
        (lambda: staged.chmod(0o644), lambda: staged.chmod(0o755), "is not executable"),
        (lambda: staged.rename(staged.with_suffix(".gone")),
         lambda: staged.with_suffix(".gone").rename(staged), "cannot be read"),
    ]:
        spoil()
        cp = vigil.run("wake", "w", "--wait", "--timeout", "60", check=False)
        assert cp.returncode != 0 and says in cp.stderr, cp.stderr
        assert says in vigil.status("w")["problem"]
        assert vigil.app_pids() == [] and not gens(vigil, "w")  # nothing ran
        vigil.quiesce(30)
        fix()
        vigil.check()
    original = staged.read_bytes()
    staged.write_bytes(original + b"# tampered\n")
    cp = vigil.run("wake", "w", "--wait", "--timeout", "60", check=False)
    assert cp.returncode != 0 and "does not match its digest" in cp.stderr, cp.stderr
    staged.write_bytes(original)
    vigil.run("wake", "w", "--wait", "--timeout", "60")
    assert vigil.status("w")["state"] == "awake"
    stop_all(vigil, "w")


def test_restart_delay_doubles_from_the_floor_to_the_cap() -> None:
    from workflows.lifecycle.restarts import restart_delay

    h = Host(restart_floor=0.5, restart_cap=3.0)
    assert [restart_delay(h, n, lambda: 0.5) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert all(near(restart_delay(h, n), b) for n, b in enumerate([0.5, 1.0, 2.0, 3.0, 3.0]))


@pytest.mark.parametrize("args, says", [
    (("--max-run", "5"), "--max-run only apply to workers"),
    (("--kind", "worker", "--restart-floor", "2", "--restart-cap", "1"), "is below --restart-floor"),
    (("--kind", "worker", "--converge-grace", "0"), "must be a positive number"),
    (("--kind", "worker", "--one-shot", "--max-run", "5"), "drop one of the two"),
])
def test_bad_worker_options_change_nothing(vigil: Vigil, args: tuple[str, ...], says: str) -> None:
    cp = vigil.run("host", "add", "w", "--build", str(WORKER), *args, check=False)
    assert cp.returncode != 0 and says in cp.stderr and len(cp.stderr.strip().splitlines()) == 1, cp
    assert vigil.store.read(lambda s: s.get(Host, "w")) is None
    assert not (vigil.state_dir / "builds").exists()
    cp = vigil.run("deploy", "nope", str(WORKER), "--converge", check=False)
    assert cp.returncode != 0 and "no host named" in cp.stderr


def test_a_run_that_stayed_up_restarts_from_the_floor(vigil: Vigil) -> None:
    """restart_reset: the streak (persisted on the host) starts again after a long run."""
    from workflows.lifecycle.workers import queue_restart

    vigil.add_host("w", WORKER, "--kind", "worker", "--restart-floor", "0.5",
                   "--restart-reset", "10")
    bid = build_id(vigil, WORKER)

    def crash(uptime: float) -> float:
        def step(s: Any) -> None:
            s.execute(Host.__table__.update().where(Host.name == "w").values(desired="up"))
            s.execute(Wake.__table__.delete())
            queue_restart(s, s.get(Host, "w"), bid, uptime, "exited")
        vigil.store.write(step)
        return events(vigil, "restart_scheduled", "w")[-1][1]["delay"]

    assert all(near(crash(1.0), b) for b in (0.5, 1.0, 2.0))
    assert near(crash(10.0), 0.5) and near(crash(1.0), 1.0)
