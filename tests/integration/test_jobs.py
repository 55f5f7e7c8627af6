"""Jobs on a schedule through the real CLI and the real agent (issue 40): every run a row,
no instant started twice across the agent's kill -9, overlap skip, `vigil run`, `vigil
runs --json`, stop disabling the schedule and ending a run in flight, bad input."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.tables import Build, Generation
from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for

pytestmark = pytest.mark.timeout(180)

SCHEDULED_RUN = FIXTURES / "scheduled_run.py"  # appends "<pid> <VIGIL_SCHEDULED_AT>" to argv[1], runs argv[2] s


def runs(v: Vigil, host: str) -> list[dict[str, Any]]:
    cp = v.run("runs", host, "--json", "--limit", "1000")
    return list(json.loads(cp.stdout))


def lines(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    return [(int(p), at) for p, at in (ln.split() for ln in path.read_text().splitlines())]


def agent(v: Vigil) -> Any:
    p = v.start_agent(None, "--sweep-interval", "0.2")
    v.wait_ready(p)
    return p


def stop_all(v: Vigil, *hosts: str) -> None:
    for h in hosts:
        v.run("stop", h, "--wait", "--timeout", "60")
    v.quiesce(30)
    v.check()
    assert v.app_pids() == []


def test_every_second_across_a_kill_9_each_instant_at_most_once(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    vigil.add_host("tick", SCHEDULED_RUN, "--kind", "job", "--every", "1", "--arg", str(out))
    p = agent(vigil)
    vigil.run("wake", "tick")
    wait_for(lambda: len(lines(out)) >= 4, 30, what="four runs")
    os.kill(p.pid, signal.SIGKILL)  # mid-way, whatever it was doing
    p.wait()
    wait_for(lambda: len(lines(out)) >= 4, 5)
    agent(vigil)
    seen = len(lines(out))
    wait_for(lambda: len(lines(out)) >= seen + 4, 30, what="four more runs after the restart")
    stop_all(vigil, "tick")
    ran = lines(out)
    rows = runs(vigil, "tick")
    instants = Counter(at for _, at in ran)
    assert all(n == 1 for n in instants.values()), f"an instant ran twice: {instants}"
    by_instant = {r["scheduled_at"]: r for r in rows}
    assert len(by_instant) == len(rows)  # one row an instant
    for pid, at in ran:  # every run in the file has its row, naming what ran
        assert at in by_instant, f"{at} ran (pid {pid}) with no row"
        assert by_instant[at]["state"] in ("done", "failed"), by_instant[at]
    started = [r for r in rows if r["state"] in ("done", "running")]
    assert {r["scheduled_at"] for r in started} <= set(instants)  # a row done: it ran
    assert all(r["exit_status"] in (0, None) for r in started)


def test_a_run_longer_than_its_period_skips_the_instants_due_meanwhile(vigil: Vigil,
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    vigil.add_host("slow", SCHEDULED_RUN, "--kind", "job", "--every", "1", "--arg", str(out),
                   "--arg", "2.5")
    agent(vigil)
    vigil.run("wake", "slow")
    wait_for(lambda: any(r["state"] == "skipped" for r in runs(vigil, "slow"))
             and any(r["state"] == "done" for r in runs(vigil, "slow")), 30,
             what="a done run and a skipped one")
    wait_for(lambda: [o for o in vigil.obligations() if o["kind"] == "job_run"], 10,
             what="an open run in pending_obligations")
    stop_all(vigil, "slow")
    rows = runs(vigil, "slow")
    skipped = [r for r in rows if r["state"] == "skipped"]
    assert all(r["generation"] is None and "overlap skip" in r["reason"] for r in skipped)
    assert len(lines(out)) == len([r for r in rows if r["generation"] is not None])
    ran = [r for r in rows if r["state"] == "done"]
    assert all(r["duration"] >= 2.4 for r in ran), ran


def test_vigil_run_now_and_runs_json(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    vigil.add_host("nightly", SCHEDULED_RUN, "--kind", "job", "--schedule", "0 3 * * *",
                   "--timezone", "Europe/Paris", "--arg", str(out), "--arg", "0", "--arg", "3")
    agent(vigil)
    cp = vigil.run("run", "nightly")
    assert "run #1 of nightly" in cp.stdout, cp.stdout
    wait_for(lambda: runs(vigil, "nightly")[0]["state"] == "failed", 30, what="the run's end")
    (row,) = runs(vigil, "nightly")
    assert row["exit_status"] == 3 and row["duration"] is not None and row["generation"]
    assert any("scheduled" in k for k in row)
    ((pid, at),) = lines(out)
    assert at == row["scheduled_at"] and pid_dead(pid)
    vigil.quiesce(30)
    vigil.check()


def test_stop_disables_the_schedule_and_ends_a_run_in_flight(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    vigil.add_host("long", SCHEDULED_RUN, "--kind", "job", "--every", "2s", "--arg", str(out),
                   "--arg", "600")
    agent(vigil)
    vigil.run("wake", "long")
    wait_for(lambda: lines(out), 30, what="a run")
    ((pid, _),) = lines(out)
    vigil.run("stop", "long", "--wait", "--timeout", "60")
    assert pid_dead(pid)
    wait_for(lambda: runs(vigil, "long")[-1]["state"] == "failed", 30, what="the run ended by the stop")
    count = len(runs(vigil, "long"))
    with pytest.raises(AssertionError):
        wait_for(lambda: len(runs(vigil, "long")) > count, 4.5, what="no run after the stop")
    vigil.quiesce(30)
    vigil.check()


@pytest.mark.parametrize("args, says", [
    (("--kind", "job", "--schedule", "61 * * * *"), "--schedule '61 * * * *' is not a cron line"),
    (("--kind", "job", "--every", "5", "--schedule", "* * * * *"), "give one of them, not both"),
    (("--kind", "job"), "a job runs --every SECONDS or on --schedule CRON"),
    (("--kind", "worker", "--every", "5"), "--every is for a job; this host is a worker"),
    (("--kind", "job", "--every", "5", "--timezone", "Mars/Olympus"), "no such time zone"),
    (("--kind", "job", "--every", "10x"), "--every 10x: not a period"),
])
def test_bad_job_input_is_one_line(vigil: Vigil, args: tuple[str, ...], says: str) -> None:
    cp = vigil.run("host", "add", "j", "--build", str(SCHEDULED_RUN), *args, check=False)
    assert cp.returncode != 0
    assert says in cp.stderr and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert vigil.run("host", "list", "--json").stdout.strip() in ("[]", "")


def test_a_job_in_the_hosts_file(vigil: Vigil, tmp_path: Path) -> None:
    f = tmp_path / "hosts.toml"
    f.write_text(f'[hosts.report]\nbuild = "{SCHEDULED_RUN}"\nkind = "job"\nschedule = "*/5 * * * *"\n'
                 f'timezone = "Europe/Paris"\nargs = ["{tmp_path / "ran.txt"}"]\n')
    vigil.run("apply", str(f))
    info = vigil.json("host", "show", "report")
    assert (info["kind"], info["schedule"], info["timezone"], info["every"]) == (
        "job", "*/5 * * * *", "Europe/Paris", None)
    assert vigil.run("apply", "--dry-run", str(f)).returncode == 0  # read back: no change
    f.write_text(f'[hosts.report]\nbuild = "{SCHEDULED_RUN}"\nkind = "job"\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    assert "a job runs every SECONDS or on schedule CRON" in cp.stderr, cp.stderr
    f.write_text(f'[hosts.report]\nbuild = "{SCHEDULED_RUN}"\nkind = "worker"\nevery = "10m"\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode != 0 and "every is for a job" in cp.stderr, cp.stderr


def test_a_deploy_sets_the_build_of_the_next_runs(vigil: Vigil, tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    vigil.add_host("rep", SCHEDULED_RUN, "--kind", "job", "--every", "1d", "--arg", str(out))
    agent(vigil)
    nxt = tmp_path / "next.py"
    nxt.write_bytes(SCHEDULED_RUN.read_bytes() + b"\n# the next build\n")
    nxt.chmod(0o755)
    cp = vigil.run("deploy", "rep", str(nxt))
    assert "is the build of rep's next runs" in cp.stdout, cp.stdout
    assert not [o for o in vigil.obligations() if o["kind"] == "attempt"]  # no attempt: no run
    vigil.run("run", "rep")
    wait_for(lambda: runs(vigil, "rep")[0]["state"] == "done", 30, what="the run")
    ((pid, _),) = lines(out)
    assert vigil.json("host", "show", "rep")["build"]["source"] == str(nxt), "the live build"
    g = runs(vigil, "rep")[0]["generation"]
    ran = vigil.store.read(lambda s: s.execute(select(Build.source).join(
        Generation, Generation.build_id == Build.id).where(Generation.id == g)).scalar_one())
    assert ran == str(nxt) and pid_dead(pid), "the run exec'd the deployed build"
    vigil.quiesce(30)
    vigil.check()
