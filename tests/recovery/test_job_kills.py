"""A job every second with its agent kill -9'd at random instants (issue 40, Done when): every
instant within the window ran exactly once. The job appends its pid and its scheduled instant
(VIGIL_SCHEDULED_AT) to a file; the file and the store's rows must agree, and no instant ran
twice. `--catch-up all` runs the instants that passed while the agent was down.

The default run is 15 s with 2 kills; VIGIL_LONG=1 runs 60 s with 5. The kills' instants are
drawn from a seeded generator (VIGIL_SEED, default 40), printed, so a failure replays."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.tables import Generation
from tests.conftest import FIXTURES, Vigil, wait_for

LONG = os.environ.get("VIGIL_LONG") == "1"
SECONDS, KILLS = (60.0, 5) if LONG else (15.0, 2)
SEED = int(os.environ.get("VIGIL_SEED", "40"))
SCHEDULED_RUN = FIXTURES / "scheduled_run.py"  # appends "<pid> <VIGIL_SCHEDULED_AT>" to argv[1]

pytestmark = pytest.mark.timeout(420 if LONG else 180)


def lines(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    return [(int(p), at) for p, at in (ln.split() for ln in path.read_text().splitlines())]


def runs(v: Vigil, host: str) -> list[dict[str, Any]]:
    return list(json.loads(v.run("runs", host, "--json", "--limit", "1000").stdout))


def agent(v: Vigil) -> Any:
    p = v.start_agent(None, "--sweep-interval", "0.2")
    v.wait_ready(p)
    return p


def kill_at_random(v: Vigil, out: Path, rnd: random.Random) -> Any:
    """The agent kill -9'd at KILLS random instants of the window, restarted each time;
    returns the last agent (alive)."""
    p = agent(v)
    v.run("wake", "tick")
    wait_for(lambda: lines(out), 30, what="the first run")
    t0 = time.monotonic()
    offsets = sorted(rnd.uniform(1.0, SECONDS - 3.0) for _ in range(KILLS))
    print(f"seed {SEED}: kills at {[round(o, 3) for o in offsets]} s")
    for at in offsets:
        time.sleep(max(0.0, t0 + at - time.monotonic()))  # the instant drawn, not a condition
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        p = agent(v)
    time.sleep(max(0.0, t0 + SECONDS - time.monotonic()))
    return p


def test_every_instant_exactly_once_across_random_kill_9s(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    vigil.add_host("tick", SCHEDULED_RUN, "--kind", "job", "--every", "1", "--catch-up", "all", "--overlap", "allow",
                   "--arg", str(out))
    kill_at_random(vigil, out, random.Random(SEED))
    stop_at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    vigil.run("stop", "tick", "--wait", "--timeout", "60")
    vigil.quiesce(30)
    vigil.check()
    assert vigil.app_pids() == []
    ran, rows = lines(out), sorted(runs(vigil, "tick"), key=lambda r: r["scheduled_at"])
    twice = {at: n for at, n in Counter(at for _, at in ran).items() if n > 1}
    assert not twice, f"instants run twice: {twice}"
    by_instant = {r["scheduled_at"]: r for r in rows}
    assert len(by_instant) == len(rows)
    in_file = {at: pid for pid, at in ran}
    assert set(in_file) <= set(by_instant), f"ran with no row: {set(in_file) - set(by_instant)}"
    # The window: the first instant to the last one a second before the stop (which may end
    # a run in flight, or one not started yet); every instant of it has its row, ran once.
    first, last = datetime.fromisoformat(rows[0]["scheduled_at"]), stop_at
    window = [(first + timedelta(seconds=k)).isoformat()
              for k in range(int((last - first).total_seconds()) + 1)]
    assert len(window) >= SECONDS - 5, f"only {len(window)} instants in {SECONDS:g} s"
    assert not set(window) - set(by_instant), (
        f"instants with no row: {sorted(set(window) - set(by_instant))}; rows: "
        + "; ".join(f"{r['scheduled_at'][11:19]} {r['state']} {r['reason'] or ''}" for r in rows))
    for at in window:
        r = by_instant[at]
        # failed with no status: it exited while no agent ran (only its parent learns it)
        unknown = r["state"] == "failed" and r["exit_status"] is None and r["generation"]
        assert r["state"] in ("done", "interrupted") or unknown, (at, r["state"], r["reason"])
        assert at in in_file, f"{at} never ran: {r}"
        if r["state"] == "interrupted":  # killed after its exec, before its pid was written
            assert "claim was taken" in (r["reason"] or ""), r
    pids = vigil.store.read(lambda s: dict(s.execute(select(Generation.id, Generation.pid).where(
        Generation.id.in_([r["generation"] for r in rows if r["generation"]]))).all()))
    for at, pid in in_file.items():  # the file and the rows agree: the pid the row recorded
        g = by_instant[at]["generation"]
        assert g is not None and pids[g] in (pid, None), (at, pid, by_instant[at])
    print(f"{len(window)} instants, {len(ran)} runs, states "
          f"{dict(Counter(r['state'] for r in rows))}")


def test_a_runs_exec_claim_taken_by_its_shim_dropped_at_release_and_after_a_death(
        vigil: Vigil, tmp_path: Path) -> None:
    """While a run runs, its exec claim is the directory its shim made; its release drops
    it; one left by a death between a proof's commit and its release is dropped by the next
    agent (a claim of a generation this store does not know is left alone)."""
    out, claims = tmp_path / "ran.txt", vigil.state_dir / "claims"
    vigil.add_host("once", SCHEDULED_RUN, "--kind", "job", "--every", "1d", "--arg", str(out),
                   "--arg", "2")
    p = agent(vigil)
    vigil.run("run", "once")
    wait_for(lambda: runs(vigil, "once")[0]["state"] == "running", 30, what="the run running")
    g = runs(vigil, "once")[0]["generation"]
    uuid = vigil.store.read(lambda s: s.execute(select(Generation.uuid).where(
        Generation.id == g)).scalar_one())
    assert (claims / uuid).is_dir() and not (claims / uuid).is_symlink()
    wait_for(lambda: runs(vigil, "once")[0]["state"] == "done", 30, what="the run done")
    wait_for(lambda: not (claims / uuid).exists(), 10, what="its claim dropped at its release")
    (claims / uuid).mkdir()  # as a death between the proof's commit and the release leaves it
    stranger = claims / "00000000-0000-4000-8000-000000000000"
    stranger.mkdir()
    vigil.stop_agent(p)
    agent(vigil)
    wait_for(lambda: not (claims / uuid).exists(), 30, what="the leftover claim released")
    assert stranger.is_dir()
    vigil.quiesce(30)
    vigil.check()
