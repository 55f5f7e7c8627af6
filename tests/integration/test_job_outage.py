"""A job's catch-up policy after a 30 s agent outage, on the real CLI and agent (issue 40
item 4): the agent kill -9'd, 30 s passed, started again. Four jobs every 5 s, one a
policy, through the one outage: about 6 instants pass with no agent. none runs none of
them; one runs the last of them once; all runs each of them once, oldest first; all with a
window runs only those in it. The others are one row, missed, its count in its reason."""

from __future__ import annotations

import os
import signal
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.store import utcnow
from models.tables import JobRun
from tests.conftest import Vigil, wait_for
from tests.integration.test_jobs import SCHEDULED_RUN, agent, lines, runs, stop_all

pytestmark = pytest.mark.timeout(240)

EVERY = 5  # seconds
OUTAGE = 30.0
EPOCH = datetime(1970, 1, 1)


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=None)


def instants(after: datetime, upto: datetime) -> list[datetime]:
    """The job's instants in (after, upto]: whole multiples of EVERY since the epoch."""
    step = timedelta(seconds=EVERY)
    t = EPOCH + ((after - EPOCH) // step + 1) * step
    out = []
    while t <= upto:
        out.append(t)
        t += step
    return out


def outage(v: Vigil, p: Any, hosts: list[str]) -> tuple[dict[str, datetime], datetime, datetime]:
    """Kill the agent, let OUTAGE seconds pass, start it again just after an instant (so
    none falls while it starts, as far as it can be helped). Returns each host's last
    instant recorded before, and the clock just before the start and once it was ready."""
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    last = {h: max(at(r["scheduled_at"]) for r in runs(v, h)) for h in hosts}
    down = utcnow()
    # the outage itself is the condition: the clock is polled until it has lasted
    wait_for(lambda: utcnow() >= down + timedelta(seconds=OUTAGE)
             and (utcnow() - EPOCH).total_seconds() % EVERY < 0.5, OUTAGE + 10,
             interval=0.05, what="30 s of outage, just past an instant")
    before = utcnow()
    agent(v)
    return last, before, utcnow()


POLICIES = ("none", "one", "all", "all-window")


def test_catch_up_after_a_30_s_outage(vigil: Vigil, tmp_path: Path) -> None:
    """One outage, four jobs on the same instants, one a policy (four outages took 160 s)."""
    outs = {f"rep-{policy}": tmp_path / f"{policy}.txt" for policy in POLICIES}
    for (host, out), policy in zip(outs.items(), POLICIES, strict=True):
        window = ("--catch-up-window", "12s") if policy == "all-window" else ()
        vigil.add_host(host, SCHEDULED_RUN, "--kind", "job", "--every", f"{EVERY}s",
                       "--catch-up", policy.split("-")[0], *window, "--arg", str(out))
    p = agent(vigil)
    for host in outs:
        vigil.run("wake", host)
    wait_for(lambda: all(lines(out) for out in outs.values())
             and not [o for o in vigil.obligations() if o["kind"] == "job_run"],
             30, what="a run of each before the outage, ended")
    last, before, ready = outage(vigil, p, list(outs))
    wait_for(lambda: all(any(at(t) > ready for _, t in lines(out)) for out in outs.values()),
             30, what="a run of each on time after")
    every = instants(last["rep-all"], before)
    wait_for(lambda: set(every) <= {at(t) for _, t in lines(outs["rep-all"])}, 30,
             what="every instant of the outage run")
    stop_all(vigil, *outs)
    for (host, out), policy in zip(outs.items(), POLICIES, strict=True):
        _check(vigil, host, out, policy, last[host], before, ready)


def _check(v: Vigil, host: str, out: Path, policy: str, last: datetime, before: datetime,
           ready: datetime) -> None:
    missed_by_none = instants(last, before)  # passed with no agent: certainly
    starting = instants(before, ready)  # passed while it started: either way
    assert len(missed_by_none) >= 5, (host, last, before)
    ran = Counter(at(t) for _, t in lines(out))
    assert all(n == 1 for n in ran.values()), f"{host}: an instant ran twice: {ran}"
    rows = v.store.read(lambda s: s.execute(select(JobRun).where(JobRun.host == host)
                                            .order_by(JobRun.id)).scalars().all())
    during = [r for r in rows if last < r.scheduled_at <= ready]
    missed = [r for r in during if r.state.value == "missed"]
    caught = [r for r in during if r.cause == "catch-up"]
    assert len(missed) <= 1, (host, [(r.scheduled_at, r.reason) for r in missed])
    check = {"none": _none, "one": _one, "all": _all, "all-window": _window}[policy]
    check(missed_by_none, starting, set(ran), missed, caught)


def _span(row: JobRun) -> str:
    return f"{row.scheduled_at.isoformat()} ({row.reason})"


def _covers(row: JobRun, first: datetime, last: datetime) -> None:
    """The missed row is at `last`, and its reason counts every instant from `first`."""
    n = int((last - first).total_seconds()) // EVERY + 1
    assert row.scheduled_at == last and row.reason is not None, _span(row)
    assert row.reason.startswith(f"{n} instant") and first.isoformat() in row.reason, _span(row)


def _none(gone: list[datetime], starting: list[datetime], ran: set[datetime],
          missed: list[JobRun], caught: list[JobRun]) -> None:
    assert not ran & set(gone), f"none ran instants of the outage: {sorted(ran & set(gone))}"
    assert not caught and len(missed) == 1
    _covers(missed[0], gone[0], missed[0].scheduled_at)
    assert missed[0].scheduled_at in gone + starting


def _one(gone: list[datetime], starting: list[datetime], ran: set[datetime],
         missed: list[JobRun], caught: list[JobRun]) -> None:
    (c,) = caught  # the last instant missed, run once
    assert c.state.value == "done" and c.scheduled_at in ran, (c.state, c.reason)
    assert c.scheduled_at in (gone[-1:] + starting), c.scheduled_at
    assert ran & set(gone) <= {c.scheduled_at}, f"one ran more: {sorted(ran & set(gone))}"
    (m,) = missed
    _covers(m, gone[0], c.scheduled_at - timedelta(seconds=EVERY))


def _all(gone: list[datetime], starting: list[datetime], ran: set[datetime],
         missed: list[JobRun], caught: list[JobRun]) -> None:
    assert set(gone) <= ran and not missed, (sorted(set(gone) - ran), missed)
    order = [r.scheduled_at for r in caught]
    assert order == sorted(order) and set(gone) <= set(order), order  # oldest first, each once
    assert all(r.state.value == "done" for r in caught), [(r.scheduled_at, r.state) for r in caught]


def _window(gone: list[datetime], starting: list[datetime], ran: set[datetime],
            missed: list[JobRun], caught: list[JobRun]) -> None:
    """A 12 s window: the instants more than 12 s old at their turn are missed (one row),
    the newer ones run, oldest first: a newest part of the outage ran, the rest did not."""
    (m,) = missed
    _covers(m, gone[0], m.scheduled_at)
    assert not ran & {t for t in gone if t <= m.scheduled_at}
    after = [t for t in gone if t > m.scheduled_at]
    assert after and set(after) <= ran and set(after) <= {r.scheduled_at for r in caught}, (
        after, sorted(ran))
    for r in caught:  # each within the window when it was written
        assert (r.since - r.scheduled_at).total_seconds() <= 12.0, _span(r)


def test_catch_up_on_add_set_show_and_the_hosts_file(vigil: Vigil, tmp_path: Path) -> None:
    """`--catch-up` and its window through host add, show, set (--dry-run, --unset) and
    the hosts file; refused in one line, nothing written, on a host that is not a job."""
    vigil.add_host("rep", SCHEDULED_RUN, "--kind", "job", "--every", "5s", "--catch-up", "all",
                   "--catch-up-window", "1h", "--arg", str(tmp_path / "ran.txt"))
    info = vigil.json("host", "show", "rep")
    assert (info["catch_up"], info["catch_up_window"]) == ("all", 3600.0)
    cp = vigil.run("host", "set", "rep", "--catch-up", "one", "--dry-run")
    assert 'catch_up "all" -> "one"' in cp.stdout and "dry run" in cp.stdout, cp.stdout
    assert vigil.json("host", "show", "rep")["catch_up"] == "all"
    cp = vigil.run("host", "set", "rep", "--catch-up", "none", check=False)  # a window with none
    assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert "none runs nothing missed" in cp.stderr, cp.stderr
    vigil.run("host", "set", "rep", "--catch-up", "none", "--unset", "catch-up-window")
    info = vigil.json("host", "show", "rep")
    assert (info["catch_up"], info["catch_up_window"]) == ("none", None)
    vigil.add_host("wrk", SCHEDULED_RUN, "--kind", "worker")
    for args in (("host", "set", "wrk", "--catch-up", "all"),
                 ("host", "add", "w2", "--build", str(SCHEDULED_RUN), "--kind", "worker",
                  "--catch-up-window", "1h")):
        cp = vigil.run(*args, check=False)
        assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
        assert "is for a job; this host is a worker" in cp.stderr, cp.stderr
    assert vigil.json("host", "show", "wrk")["kind"] == "worker"
    assert "w2" not in vigil.run("host", "list").stdout
    f = tmp_path / "hosts.toml"
    f.write_text(f'[hosts.nightly]\nbuild = "{SCHEDULED_RUN}"\nkind = "job"\nevery = "1d"\n'
                 'catch_up = "all"\ncatch_up_window = "12h"\n')
    vigil.run("apply", str(f))
    info = vigil.json("host", "show", "nightly")
    assert (info["catch_up"], info["catch_up_window"]) == ("all", 43200.0)
    f.write_text(f'[hosts.nightly]\nbuild = "{SCHEDULED_RUN}"\nkind = "worker"\n'
                 'catch_up = "all"\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode != 0 and "hosts.nightly.catch_up: catch_up is for a job" in cp.stderr, (
        cp.stderr)
