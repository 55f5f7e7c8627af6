"""A job every second on two boxes sharing one PostgreSQL store (issue 40, Done when): the box
that holds it is kill -9'd (not restarted), the other takes it over after the lease's TTL and
runs the instants passed meanwhile (`--catch-up all`): no instant ran twice, every instant of
the window has its row and ran once, and the file the runs append to agrees with the rows."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from models.states import GenState
from models.store import utcnow
from models.tables import Event, Generation, JobRun, Lease
from tests.conftest import FIXTURES, wait_for
from tests.multibox.conftest import LEASE_TTL, Box

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.postgresql_only("several boxes share one PostgreSQL store")]

SCHEDULED_RUN = FIXTURES / "scheduled_run.py"  # appends "<pid> <VIGIL_SCHEDULED_AT>" to argv[1]


def lines(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    return [(int(p), at) for p, at in (ln.split() for ln in path.read_text().splitlines())]


def runs(box: Box) -> list[dict[str, Any]]:
    return sorted(json.loads(box.run("runs", "tick", "--json", "--limit", "1000").stdout),
                  key=lambda r: r["scheduled_at"])


def run_boxes(box: Box) -> dict[int, str]:
    """generation -> the box (agent) that started it."""
    return dict(box.store.read(lambda s: s.execute(select(Generation.id, Generation.agent_id)
                                                   .where(Generation.host == "tick")).all()))


def test_a_job_on_two_boxes_one_killed_runs_each_instant_once(boxes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a, b = boxes("a"), boxes("b")
    out = tmp_path / "ran.txt"
    a.run("host", "add", "tick", "--build", str(SCHEDULED_RUN), "--kind", "job", "--every", "1",
          "--catch-up", "all", "--overlap", "allow", "--arg", str(out), "--arg", "0.6",
          "--box", "a", "--box", "b")  # runs of 0.6 s: caught up one at a time, faster than 1/s
    (b.state_dir / "builds").symlink_to(a.state_dir / "builds")  # one staging root (a fleet's)
    agents = {"a": a.start(), "b": b.start()}
    a.run("wake", "tick")
    wait_for(lambda: len(lines(out)) >= 3, 60, what="three runs")
    # The box of a run started in the last 0.2 s: it holds the job's lease for 0.4 s more
    # at least (each run takes it and gives it back), so the kill leaves a lease to take over.
    holder = wait_for(lambda: a.store.read(lambda s: s.execute(
        select(Generation.agent_id).join(JobRun, JobRun.generation_id == Generation.id).join(
            Lease, Lease.host == Generation.host).where(
            Generation.state == GenState.current, Lease.holder == Generation.agent_id,
            Generation.current_at > utcnow() - timedelta(seconds=0.2))).scalar()),
        30, interval=0.02, what="a run just started")
    victim, survivor = (a, b) if holder == "a" else (b, a)
    agents[victim.name].send_signal(signal.SIGKILL)
    agents[victim.name].wait(10)
    killed, killed_at = time.monotonic(), datetime.now(UTC)
    def by_survivor() -> int:  # runs of instants after the kill started by the survivor
        since = killed_at.replace(tzinfo=None)
        return int(a.store.read(lambda s: s.execute(
            select(func.count()).select_from(JobRun).join(
                Generation, Generation.id == JobRun.generation_id).where(
                Generation.agent_id == survivor.name, JobRun.scheduled_at > since)).scalar_one()))

    wait_for(lambda: by_survivor() > 0, LEASE_TTL * 4 + 30, interval=0.5,
             what=f"box {survivor.name} running the job")
    print(f"{survivor.name} ran it {time.monotonic() - killed:.1f}s after {victim.name}'s kill")
    later = (datetime.now(UTC) + timedelta(seconds=4)).isoformat()  # past its catch-up
    wait_for(lambda: any(r["scheduled_at"] >= later and r["state"] == "done" for r in runs(a)),
             60, interval=0.5, what="runs on time after the takeover")
    stop_at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    survivor.run("stop", "tick", "--wait", "--timeout", "60")
    wait_for(lambda: not [o for o in survivor.obligations() if o["kind"] == "job_run"], 30,
             what="every run closed")

    ran, rows = lines(out), runs(a)
    twice = {at: n for at, n in Counter(at for _, at in ran).items() if n > 1}
    assert not twice, f"instants run twice: {twice}"
    by_instant = {r["scheduled_at"]: r for r in rows}
    in_file = {at: pid for pid, at in ran}
    assert set(in_file) <= set(by_instant), f"ran with no row: {set(in_file) - set(by_instant)}"
    first = datetime.fromisoformat(rows[0]["scheduled_at"])
    window = [(first + timedelta(seconds=k)).isoformat()
              for k in range(int((stop_at - first).total_seconds()) + 1)]
    assert not set(window) - set(by_instant), f"no row: {set(window) - set(by_instant)}"
    assert first < killed_at and killed_at + timedelta(seconds=LEASE_TTL) < stop_at, \
        f"the outage is not in the window {first}..{stop_at}"
    for at in window:
        r = by_instant[at]
        # failed with no status: exited while no agent of its box ran, or fenced by the
        # killed box's keeper and settled by the takeover; interrupted: its claim was taken
        assert r["state"] in ("done", "interrupted") or (
            r["state"] == "failed" and r["exit_status"] is None), (at, r["state"], r["reason"])
        if r["state"] != "failed" or "fenced" not in (r["reason"] or ""):
            assert at in in_file, f"{at} never ran: {r}"
    assert a.store.read(lambda s: s.execute(select(func.count()).select_from(Event).where(
        Event.kind == "taken_over")).scalar_one()) >= 1, "no takeover: the victim held nothing"
    print(f"{len(window)} instants; states {dict(Counter(r['state'] for r in rows))}; "
          f"by box {dict(Counter(run_boxes(a).values()))}")
