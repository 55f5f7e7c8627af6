"""Rollouts step by step on a real store (SQLite file or PostgreSQL): each `advance` is one
transaction of the workflow (workflows/rollouts/driver.py); the attempts it writes are ended by
hand here, as their drivers would end them. Processes and agents: tests/integration,
tests/recovery, tests/multibox."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from models import schema
from models.errors import BadInput, Refused
from models.statedir import prepare_state_dir
from models.states import (
    AttemptStep,
    Cause,
    GenState,
    HostKind,
    Mode,
    Outcome,
    RolloutOutcome,
    RolloutState,
    TargetState,
    WakeState,
)
from models.store import Store, utcnow
from models.tables import (
    Attempt,
    Build,
    Event,
    Generation,
    HeldBuild,
    Host,
    Rollout,
    RolloutTarget,
    Wake,
)
from models.transition import Unfenced, move
from tests.conftest import drop_db, new_db
from workflows.base.context import Context, Result
from workflows.builds import book
from workflows.deploys.request import request_deploy
from workflows.deploys.schedules import request_restart
from workflows.engine.obligations import Due, run_one
from workflows.lifecycle.stop import request_stop
from workflows.lifecycle.workers import queue_restart
from workflows.rollouts.driver import REISSUES, Wait, advance
from workflows.rollouts.request import (
    abort_rollout,
    pause_rollout,
    request_rollout,
    resume_rollout,
)
from workflows.rollouts.steps import (
    ENDED,
    HALTED,
    REISSUED,
    REVERT_SETTLED,
    REVERT_STARTED,
    WAVE_ADMITTED,
    WAVE_SETTLED,
)
from workflows.rollouts.waves import wave_ends

HOSTS = ["web1", "web2", "web3", "web4"]
BY_HAND = Unfenced("the test ends attempts as their drivers would")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(new_db(prepare_state_dir(tmp_path / "state")))
    schema.upgrade(s.engine)
    try:
        yield s
    finally:
        s.dispose()
        drop_db(s.url)


@pytest.fixture
def builds(store: Store) -> tuple[int, int]:
    """Builds #old and #new; every host of HOSTS on the old one, with a current generation."""
    def step(s: Session) -> tuple[int, int]:
        now = utcnow()
        old = Build(digest="a" * 64, path="/b/old", source="/s/old", created_at=now)
        new = Build(digest="b" * 64, path="/b/new", source="/s/new", created_at=now)
        s.add_all([old, new])
        s.flush()
        for i, h in enumerate(HOSTS):
            s.add(Host(name=h, kind=HostKind.instance, build_id=old.id, created_at=now))
            s.flush()
            s.add(Generation(uuid=f"u-{i}", host=h, build_id=old.id, state=GenState.current,
                             fence=1, pid=1000 + i, agent_id="a", created_at=now, current_at=now))
        return old.id, new.id

    return store.write(step)


def start(store: Store, build_id: int, hosts: list[str] = HOSTS, **kw: Any) -> int:
    opts: dict[str, Any] = {"waves": "1,100%", "mode": Mode.overlap, "canary": False,
                            "pause": None, "max_failures": 0, "auto_revert": False, **kw}
    return store.write(lambda s: request_rollout(s, s.get(Build, build_id), hosts,
                                                         **opts)).id


def step(store: Store, rid: int) -> Any:
    return store.write(lambda s: advance(s, rid))


def targets(store: Store, rid: int) -> dict[str, RolloutTarget]:
    return {t.host: t for t in store.read(lambda s: s.execute(
        select(RolloutTarget).where(RolloutTarget.rollout_id == rid)).scalars().all())}


def the(store: Store, rid: int) -> Rollout:
    return store.read(lambda s: s.get(Rollout, rid))


def attempt(store: Store, aid: int) -> Attempt:
    return store.read(lambda s: s.get(Attempt, aid))


def end(store: Store, aid: int | None, outcome: Outcome, executed: bool = True,
        reason: str = "by hand", switch_to: int | None = None) -> None:
    """End an attempt as its driver would: the row, the failure book, the rollout's nudge;
    a done one also moves the host (and its current generation) onto its build."""
    assert aid is not None

    def go(s: Session) -> None:
        a = s.get(Attempt, aid)
        move(s, Attempt, {"id": aid}, {"step": AttemptStep.ended, "outcome": outcome,
                               "executed": executed, "reason": reason, "ended_at": utcnow()},
             f"attempt #{aid} ended", fence=BY_HAND, col="step",
             frm=[x for x in AttemptStep if x is not AttemptStep.ended])
        if outcome is Outcome.done:
            s.execute(Host.__table__.update().where(Host.name == a.host).values(build_id=a.build_id))
            s.execute(Generation.__table__.update().where(
                Generation.host == a.host, Generation.state == GenState.current)
                .values(build_id=a.build_id))
        book.attempt_ended(s, a, outcome, reason)

    store.write(go)


def events(store: Store, kind: str) -> list[Event]:
    return store.read(lambda s: s.execute(select(Event).where(Event.kind == kind)
                                          .order_by(Event.id)).scalars().all())


# -- waves ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,hosts,ends", [
    ("1,25%,100%", 6, [1, 2, 6]), ("1,50%,100%", 6, [1, 3, 6]), ("100%", 3, [3]),
    ("1", 4, [1, 4]), ("2,2,3", 5, [2, 3, 5]), ("50%", 1, [1]), ("1,25%,100%", 1, [1]),
    ("10", 3, [3]), ("12.5%,100%", 8, [1, 8]), ("3,25%", 4, [3, 4]),
])
def test_wave_sizes_are_cumulative_and_reach_every_host(spec: str, hosts: int, ends: list[int]) -> None:
    assert wave_ends(spec, hosts) == ends


@pytest.mark.parametrize("spec", ["", " ", "0", "1,,2", "abc", "150%", "0%", "-1", "3,1", "nan%",
                                  "inf%"])
def test_bad_waves_are_one_line(spec: str) -> None:
    with pytest.raises(BadInput) as err:
        wave_ends(spec, 4)
    assert "--waves" in err.value.cause and "--waves 1,25%,100%" in (err.value.fix or "")


# -- the workflow -------------------------------------------------------------------------------


def test_a_wave_starts_only_when_the_one_before_settled(store: Store, builds: tuple[int, int]) -> None:
    old, new = builds
    rid = start(store, new)
    assert the(store, rid).wave_count == 2
    assert step(store, rid) == WAVE_ADMITTED
    t = targets(store, rid)
    assert t["web1"].state is TargetState.deploying and t["web1"].from_build_id == old
    assert {t[h].state for h in HOSTS[1:]} == {TargetState.pending}
    a1 = attempt(store, t["web1"].attempt_id)
    assert a1.cause is Cause.rollout and a1.build_id == new and a1.outcome is None
    # Asked again and again while its attempt runs: it waits, and writes nothing more.
    for _ in range(3):
        assert isinstance(step(store, rid), Wait)
    assert len(store.read(lambda s: s.execute(select(Attempt)).scalars().all())) == 1
    end(store, a1.id, Outcome.done)
    assert the(store, rid).next_attempt_at <= utcnow()  # the attempt's end made it due
    assert step(store, rid) == WAVE_SETTLED
    assert targets(store, rid)["web1"].state is TargetState.done
    assert step(store, rid) == WAVE_ADMITTED
    t = targets(store, rid)
    assert {t[h].state for h in HOSTS[1:]} == {TargetState.deploying}
    for h in HOSTS[1:3]:
        end(store, t[h].attempt_id, Outcome.done)
    assert "waiting for 1 attempt(s) to end (web4)" in step(store, rid).why
    end(store, t["web4"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED
    assert step(store, rid) == ENDED
    r = the(store, rid)
    assert r.state is RolloutState.ended and r.outcome is RolloutOutcome.done, r.reason
    assert step(store, rid) is None  # an ended rollout is no longer driven
    assert [e.kind for e in events(store, "rollout_ended")] == ["rollout_ended"]
    # One attempt per host: none was deployed twice.
    per_host = store.read(lambda s: s.execute(select(Attempt.host)).scalars().all())
    assert sorted(per_host) == HOSTS


def test_a_failure_halts_cancels_what_has_not_started_and_reverts(store: Store,
                                                                   builds: tuple[int, int]) -> None:
    old, new = builds
    rid = start(store, new, auto_revert=True)
    assert step(store, rid) == WAVE_ADMITTED
    end(store, targets(store, rid)["web1"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED
    assert step(store, rid) == WAVE_ADMITTED
    t = targets(store, rid)
    end(store, t["web2"].attempt_id, Outcome.failed, reason="health: status 500")
    # web3's attempt was started by its driver before the halt; web4's was not.
    store.write(lambda s: move(s, Attempt, {"id": t["web3"].attempt_id}, {"step": AttemptStep.admitted},
                               "admitted", fence=BY_HAND, col="step", frm=AttemptStep.queued))
    assert step(store, rid) == HALTED
    r = the(store, rid)
    assert r.state is RolloutState.halted
    assert r.reason == f"host web2 failed: attempt #{t['web2'].attempt_id} failed: health: status 500"
    a4 = attempt(store, t["web4"].attempt_id)
    assert a4.outcome is Outcome.cancelled and a4.executed is False
    assert a4.reason.startswith(f"rollout #{rid} halted")
    assert attempt(store, t["web3"].attempt_id).outcome is None  # running: it finishes
    assert isinstance(step(store, rid), Wait)
    end(store, t["web3"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED
    t = targets(store, rid)
    assert (t["web1"].state, t["web2"].state, t["web3"].state, t["web4"].state) == (
        TargetState.done, TargetState.failed, TargetState.done, TargetState.skipped)
    # The failure book holds the build down on web2.
    assert store.read(lambda s: book.held(s, "web2", new)) is not None
    assert step(store, rid) == REVERT_STARTED
    t = targets(store, rid)
    assert t["web1"].state is t["web3"].state is TargetState.reverting
    for h in ("web1", "web3"):
        back = attempt(store, t[h].revert_attempt_id)
        assert back.build_id == old and back.cause is Cause.rollout
    end(store, t["web1"].revert_attempt_id, Outcome.done)
    assert isinstance(step(store, rid), Wait)
    end(store, t["web3"].revert_attempt_id, Outcome.done)
    assert step(store, rid) == REVERT_SETTLED
    assert step(store, rid) == ENDED
    r = the(store, rid)
    assert r.outcome is RolloutOutcome.reverted and "2 host(s) reverted" in (r.reason or "")
    t = targets(store, rid)
    assert t["web1"].state is t["web3"].state is TargetState.reverted


def test_max_failures_tolerates_that_many_failed_hosts(store: Store, builds: tuple[int, int]) -> None:
    _, new = builds
    rid = start(store, new, waves="100%", max_failures=1)
    assert step(store, rid) == WAVE_ADMITTED
    t = targets(store, rid)
    end(store, t["web1"].attempt_id, Outcome.failed)
    assert isinstance(step(store, rid), Wait)  # one failure is tolerated
    end(store, t["web2"].attempt_id, Outcome.down)
    assert step(store, rid) == HALTED
    assert "2 hosts failed (at most 1 allowed)" in (the(store, rid).reason or "")


def test_an_interrupted_attempt_is_written_again_a_superseded_one_is_not(
        store: Store, builds: tuple[int, int]) -> None:
    old, new = builds
    rid = start(store, new, hosts=["web1", "web2", "web3"], waves="100%")
    assert step(store, rid) == WAVE_ADMITTED
    t = targets(store, rid)
    # web1: the agent restarted mid-swap (abandoned after running); web3: abandoned before
    # anything ran (it gives its allowance back); web2: a newer deploy took the host.
    end(store, t["web1"].attempt_id, Outcome.abandoned, True, "interrupted at step spawned")
    end(store, t["web3"].attempt_id, Outcome.abandoned, False, "interrupted at step admitted")
    newer = store.write(lambda s: request_deploy(s, "web2", s.get(Build, old), mode=Mode.overlap,
                                                 canary=False, cause=Cause.release).id)
    end(store, t["web2"].attempt_id, Outcome.abandoned, True, "superseded by a newer attempt")
    assert step(store, rid) == REISSUED
    again = targets(store, rid)
    assert again["web1"].attempt_id != t["web1"].attempt_id
    assert (again["web1"].tries, again["web1"].spent) == (2, 1)
    assert (again["web3"].tries, again["web3"].spent) == (2, 0)
    assert again["web2"].attempt_id == t["web2"].attempt_id  # not written again
    end(store, again["web1"].attempt_id, Outcome.done)
    end(store, again["web3"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED
    t = targets(store, rid)
    assert t["web2"].state is TargetState.abandoned
    assert t["web2"].reason == f"superseded by attempt #{newer} (cause release)"
    assert step(store, rid) == ENDED
    assert the(store, rid).outcome is RolloutOutcome.done


def test_reissues_stop_after_the_allowance(store: Store, builds: tuple[int, int]) -> None:
    _, new = builds
    rid = start(store, new, hosts=["web1"], waves="100%")
    assert step(store, rid) == WAVE_ADMITTED
    for _ in range(REISSUES):
        end(store, targets(store, rid)["web1"].attempt_id, Outcome.abandoned, True, "lease lost")
        assert step(store, rid) == REISSUED
    end(store, targets(store, rid)["web1"].attempt_id, Outcome.abandoned, True, "lease lost")
    assert step(store, rid) == WAVE_SETTLED
    t = targets(store, rid)["web1"]
    assert t.state is TargetState.abandoned and "given up after 4 attempt(s)" in (t.reason or "")


def test_a_stop_or_a_newer_deploy_before_its_wave_supersedes_a_target(
        store: Store, builds: tuple[int, int]) -> None:
    old, new = builds
    rid = start(store, new, hosts=["web1", "web2", "web3"], waves="1")
    store.write(lambda s: request_stop(s, "web2"))
    store.write(lambda s: request_deploy(s, "web3", s.get(Build, old), mode=Mode.overlap,
                                         canary=False, cause=Cause.release))
    assert step(store, rid) == WAVE_ADMITTED
    end(store, targets(store, rid)["web1"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED
    assert step(store, rid) == WAVE_ADMITTED
    t = targets(store, rid)
    assert t["web2"].state is t["web3"].state is TargetState.abandoned
    assert "stopped (stop #" in (t["web2"].reason or "")
    assert "superseded by attempt #" in (t["web3"].reason or "")
    assert step(store, rid) == WAVE_SETTLED
    assert step(store, rid) == ENDED
    r = the(store, rid)
    assert r.outcome is RolloutOutcome.done and "2 abandoned" in (r.reason or "")


def test_held_down_hosts_are_skipped_and_named(store: Store, builds: tuple[int, int]) -> None:
    _, new = builds
    aid = store.write(lambda s: request_deploy(s, "web1", s.get(Build, new), mode=Mode.overlap,
                                               canary=False, cause=Cause.release).id)
    end(store, aid, Outcome.failed, reason="health: status 500")
    started = store.write(lambda s: request_rollout(
        s, s.get(Build, new), ["web1", "web2"], waves="100%", mode=Mode.overlap, canary=False,
        pause=None, max_failures=0, auto_revert=False))
    (host, why), = started.skipped
    assert host == "web1" and "is held down on web1 since attempt" in why and "vigil retry web1" in why
    assert started.waves == [["web2"]]
    with pytest.raises(Refused) as err:
        start(store, new, hosts=["web1"])
    assert "nothing to roll out: web1: build bbbbbbbbbbbb is held down" in str(err.value)
    # `vigil retry` lifts it (the CLI's intent); an attempt of it that ends done would too.
    assert store.write(lambda s: book.lift(s, "web1", new, "vigil retry"))
    assert store.read(lambda s: s.execute(select(HeldBuild)).first()) is None


def test_scheduled_and_worker_restarts_skip_a_held_build(store: Store, builds: tuple[int, int]) -> None:
    old, _ = builds
    aid = store.write(lambda s: request_deploy(s, "web1", s.get(Build, old), mode=Mode.overlap,
                                               canary=False, cause=Cause.release).id)
    end(store, aid, Outcome.failed, reason="exited during the canary settle")
    assert store.write(lambda s: request_restart(s, "web1")) is None
    (skipped,) = events(store, "restart_skipped")
    assert "is held down on web1" in skipped.detail

    def worker(s: Session) -> None:
        s.execute(Host.__table__.update().where(Host.name == "web1").values(
            kind=HostKind.worker, desired="up"))

    store.write(worker)
    store.write(lambda s: queue_restart(s, s.get(Host, "web1"), old, 5.0, "exited"))
    assert store.read(lambda s: s.execute(select(Wake).where(Wake.state == WakeState.queued))
                      .first()) is None
    assert len(events(store, "restart_skipped")) == 2


def test_pause_resume_abort(store: Store, builds: tuple[int, int]) -> None:
    _, new = builds
    rid = start(store, new)
    assert step(store, rid) == WAVE_ADMITTED
    assert "paused" in store.write(lambda s: pause_rollout(s, rid))
    end(store, targets(store, rid)["web1"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED  # the wave in flight settles while paused
    assert "paused by the operator before wave 2" in step(store, rid).why
    assert "already paused" in store.write(lambda s: pause_rollout(s, rid))
    store.write(lambda s: resume_rollout(s, rid))
    assert step(store, rid) == WAVE_ADMITTED
    t = targets(store, rid)
    store.write(lambda s: move(s, Attempt, {"id": t["web2"].attempt_id}, {"step": AttemptStep.admitted},
                               "admitted", fence=BY_HAND, col="step", frm=AttemptStep.queued))
    assert "cancelled" in store.write(lambda s: abort_rollout(s, rid))
    assert attempt(store, t["web3"].attempt_id).outcome is Outcome.cancelled
    assert attempt(store, t["web4"].attempt_id).outcome is Outcome.cancelled
    end(store, t["web2"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED
    assert step(store, rid) == ENDED
    r = the(store, rid)
    assert r.outcome is RolloutOutcome.aborted
    t = targets(store, rid)
    assert (t["web2"].state, t["web3"].state, t["web4"].state) == (
        TargetState.done, TargetState.skipped, TargetState.skipped)
    for intent in (pause_rollout, resume_rollout, abort_rollout):
        with pytest.raises(Refused):
            store.write(lambda s, intent=intent: intent(s, rid))


def test_the_pause_between_waves_is_a_due_time_on_the_row(store: Store, builds: tuple[int, int],
                                                          tmp_path: Path) -> None:
    _, new = builds
    rid = start(store, new, pause=30.0)
    assert step(store, rid) == WAVE_ADMITTED
    end(store, targets(store, rid)["web1"].attempt_id, Outcome.done)
    assert step(store, rid) == WAVE_SETTLED
    due = the(store, rid).wave_due_at
    assert due is not None and timedelta(seconds=29) < due - utcnow() <= timedelta(seconds=30)
    wait = step(store, rid)
    assert isinstance(wait, Wait) and wait.until == due
    # The reconciler's pacing keeps it: next due at that time, no backoff counted.
    ctx = Context(store=store, agent_id="a", state_dir=tmp_path, proc=None, health=None,  # type: ignore[arg-type]
                  files=None)  # type: ignore[arg-type]
    result, error = run_one(ctx, Due("rollout", rid, f"rollout #{rid}", utcnow(), 0, None, True))
    assert result is Result.waiting and "pausing before wave 2" in (error or "")
    r = the(store, rid)
    assert r.next_attempt_at == due and r.attempts == 0


def test_gc_keeps_the_builds_an_open_rollout_may_deploy(store: Store, builds: tuple[int, int]) -> None:
    from workflows.builds.staged import referenced_ids

    old, new = builds
    store.write(lambda s: s.execute(Host.__table__.update().values(build_id=old)))
    rid = start(store, new)
    assert new in store.read(referenced_ids)
    store.write(lambda s: abort_rollout(s, rid))
    assert step(store, rid) == ENDED
    assert new not in store.read(referenced_ids)


def test_check_names_a_target_left_in_flight_by_an_ended_rollout(store: Store,
                                                                 builds: tuple[int, int],
                                                                 tmp_path: Path) -> None:
    from runners.cli.check import run_checks

    _, new = builds
    rid = start(store, new)
    assert step(store, rid) == WAVE_ADMITTED
    assert not [v for v in run_checks(store, tmp_path) if v.name == "rollout_target"]
    store.write(lambda s: move(s, Rollout, {"id": rid}, {"state": RolloutState.ended},
                               "by hand", fence=BY_HAND, col="state", frm=RolloutState.running))
    found = {v.message for v in run_checks(store, tmp_path) if v.name == "rollout_target"}
    assert found == {f"target web1 of rollout #{rid} is deploying while the rollout is ended",
                     *{f"target {h} of rollout #{rid} is pending while the rollout is ended"
                       for h in HOSTS[1:]}}
