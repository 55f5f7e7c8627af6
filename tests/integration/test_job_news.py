"""A job's runs heard and seen (issue 40, item 5), on real agents and real runs: `--on
run_failed` and `--on run_late` told of a failed run and of a run started late (the agent
killed after its row was due), a run done telling nobody; `vigil status` (table at 80
columns, JSON), `host show`, `top`, the page and the metrics saying a job's next run and
last result (`scheduled`, not `asleep`); `vigil logs HOST --run N` printing one run's
output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from models.store import utcnow
from models.tables import Delivery, Event
from tests.conftest import FIXTURES, ROOT, Vigil, wait_for
from tests.integration.test_notifications import receiver
from tests.integration.test_operator import scrape, value
from tests.integration.test_ui import browser, ended, get, serve  # noqa: F401 (a fixture)
from tests.listening import free_port

pytestmark = pytest.mark.timeout(240)

SCHEDULED_RUN = FIXTURES / "scheduled_run.py"  # appends "<pid> <instant>" to argv[1], sleeps argv[2], exits argv[3]
# A job every 2 s, read at any instant: between runs, a run starting, running, or its
# processes being proven gone after it exited.
BETWEEN = ("scheduled", "waking", "running", "retiring")
SAYS = """import os, sys, time
print("run of", os.environ["VIGIL_SCHEDULED_AT"], flush=True)
time.sleep(float(sys.argv[1]))
"""


def runs(v: Vigil, host: str) -> list[dict[str, Any]]:
    return list(json.loads(v.run("runs", host, "--json", "--limit", "1000").stdout))


def agent(v: Vigil, *extra: str) -> Any:
    p = v.start_agent(None, "--sweep-interval", "0.2", *extra)
    v.wait_ready(p)
    return p


def events(v: Vigil, kind: str) -> list[dict[str, Any]]:
    return v.store.read(lambda s: [{"host": e.host, **json.loads(e.detail)} for e in s.execute(
        select(Event).where(Event.kind == kind).order_by(Event.id)).scalars()])


def received(got: Path) -> list[str]:
    return [line.split()[1] for line in got.read_text().splitlines()] if got.exists() else []


def test_a_failed_run_and_a_late_one_are_notified_a_done_one_is_not(vigil: Vigil,
                                                                     short_tmp: Path) -> None:
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "run_failed,run_late", "--exec", command)
    out = short_tmp / "ran.txt"
    vigil.add_host("flaky", SCHEDULED_RUN, "--kind", "job", "--every", "1d", "--arg", str(out),
                   "--arg", "0", "--arg", "3")
    vigil.add_host("fine", SCHEDULED_RUN, "--kind", "job", "--every", "1d", "--arg", str(out))
    vigil.add_host("tick", SCHEDULED_RUN, "--kind", "job", "--every", "5", "--arg", str(out))
    # The agent dies right after a run of tick is written due: the next one starts it late.
    crashing = vigil.start_agent("job.due", "--sweep-interval", "0.2")
    vigil.wait_ready(crashing)
    vigil.run("wake", "tick")
    crashing.wait(60)
    assert crashing.returncode == -signal.SIGKILL
    (due,) = runs(vigil, "tick")
    assert due["state"] == "due", due
    instant = datetime.fromisoformat(due["scheduled_at"]).replace(tzinfo=None)
    wait_for(lambda: (utcnow() - instant).total_seconds() > 1.5, 10,
             what="the due run past its late bound (1 s for --every 5)")
    agent(vigil)
    vigil.run("run", "flaky")
    vigil.run("run", "fine")
    wait_for(lambda: runs(vigil, "fine")[0]["state"] == "done"
             and runs(vigil, "flaky")[0]["state"] == "failed", 30, what="both runs' ends")
    wait_for(lambda: [r for r in runs(vigil, "tick") if r["id"] == due["id"]
                      and r["state"] in ("done", "failed")], 30, what="the late run's end")
    vigil.run("stop", "tick", "--wait", "--timeout", "60")
    (late,) = [e for e in events(vigil, "run_late") if e["run"] == due["id"]]
    assert late["host"] == "tick" and late["late_by"] > 1.5 and late["bound"] == 1.0, late
    (failed,) = [e for e in events(vigil, "run_ended") if e["host"] == "flaky"]
    assert failed["result"] == "failed" and failed["exit_code"] == 3, failed
    wait_for(lambda: {"run_ended", "run_late"} <= set(received(got)), 30,
             what="run_failed and run_late delivered")
    owed = vigil.store.read(lambda s: {(d.host, d.word) for d in s.execute(select(Delivery))
                                       .scalars()})
    assert {("flaky", "run_failed"), ("tick", "run_late")} <= owed, owed
    assert not [h for h, _ in owed if h == "fine"], owed  # a run done tells nobody
    vigil.quiesce(30)
    vigil.check()


def test_a_run_interrupted_by_the_agents_death_is_a_run_failed(vigil: Vigil,
                                                                short_tmp: Path) -> None:
    """The agent killed after the run's spawn, before its pid was written: the next agent
    records the run interrupted (not run again) and `--on run_failed` is told."""
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "run_failed", "--exec", command)
    vigil.add_host("cut", SCHEDULED_RUN, "--kind", "job", "--every", "1d", "--arg",
                   str(short_tmp / "ran.txt"), "--arg", "30")
    crashing = vigil.start_agent("wake.spawned", "--sweep-interval", "0.2")
    vigil.wait_ready(crashing)
    vigil.run("run", "cut")
    crashing.wait(60)
    assert crashing.returncode == -signal.SIGKILL
    agent(vigil)
    wait_for(lambda: runs(vigil, "cut")[0]["state"] == "interrupted", 30,
             what="the run recorded interrupted")
    (ended_,) = [e for e in events(vigil, "run_ended") if e["host"] == "cut"]
    assert ended_["result"] == "interrupted" and ended_["exit_code"] is None, ended_
    wait_for(lambda: received(got) == ["run_ended"], 30, what="run_failed delivered")
    assert len(runs(vigil, "cut")) == 1  # not run again
    vigil.quiesce(30)
    vigil.check()


def test_instants_missed_while_no_agent_ran_are_a_run_missed(vigil: Vigil,
                                                              short_tmp: Path) -> None:
    """The agent kill -9'd for over 4 periods of a job every second: the next one records
    the instants missed in the outage (catch-up one: one row, the last of them run) and
    `--on run_missed` is told of it, once."""
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "run_missed", "--exec", command)
    vigil.add_host("tick", SCHEDULED_RUN, "--kind", "job", "--every", "1", "--arg",
                   str(short_tmp / "ran.txt"))
    p = agent(vigil)
    vigil.run("wake", "tick")
    wait_for(lambda: any(r["state"] == "done" for r in runs(vigil, "tick")), 30, what="a run")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    down = utcnow()
    last = max(datetime.fromisoformat(r["scheduled_at"]).replace(tzinfo=None)
               for r in runs(vigil, "tick"))
    # Over 4 periods: at least 4 instants pass (the kill may land just after one), the newest
    # of them runs (catch-up one) and at least 3 are missed. 3.5 s gave 3 instants at times.
    wait_for(lambda: (utcnow() - down).total_seconds() > 4.5, 10, what="an outage of 4 periods")
    agent(vigil)

    def outage() -> list[dict[str, Any]]:
        return [e for e in events(vigil, "run_missed")
                if datetime.fromisoformat(e["first"]) > last]

    wait_for(outage, 30, what="the instants missed in the outage recorded")
    (missed,) = outage()
    assert missed["host"] == "tick" and missed["count"] >= 3, missed
    assert [r["state"] for r in runs(vigil, "tick") if r["id"] == missed["run"]] == ["missed"]
    every = len(events(vigil, "run_missed"))  # each one delivered, the outage's among them
    wait_for(lambda: received(got).count("run_missed") >= every, 30, what="run_missed delivered")
    vigil.run("stop", "tick", "--wait", "--timeout", "60")
    vigil.quiesce(30)
    vigil.check()


@pytest.mark.backend("the jobs' grouped reads (newest run per host, last success) and the "
                     "metrics' counts, per dialect")
def test_status_show_top_and_metrics_say_next_run_and_last_result(vigil: Vigil,
                                                                  short_tmp: Path) -> None:
    out = short_tmp / "ran.txt"
    vigil.add_host("payments-nightly-report", SCHEDULED_RUN, "--kind", "job", "--every", "2",
                   "--arg", str(out))
    vigil.add_host("off", SCHEDULED_RUN, "--kind", "job", "--every", "1h", "--arg", str(out))
    port = free_port()
    agent(vigil, "--metrics-listen", f"127.0.0.1:{port}")
    name = "payments-nightly-report"
    off = vigil.json("status", "off")[0]
    assert off["state"] == "asleep" and off["next_run"] is None and off["last_run"] is None, off
    started = utcnow()
    vigil.run("wake", name)
    wait_for(lambda: (vigil.json("status", name)[0]["last_run"] or {}).get("state") == "done",
             30, what="a run done")
    wait_for(lambda: vigil.json("status", name)[0]["state"] == "scheduled", 30,
             what="between runs: scheduled")
    before = utcnow()
    st = vigil.json("status", name)[0]
    nxt = datetime.fromisoformat(st["next_run"].removesuffix("Z"))
    assert before < nxt <= utcnow() + timedelta(seconds=2), st  # the first after the read
    last = st["last_run"]
    assert last["exit_status"] == 0 and st["last_success"] == last["ended_at"], st

    table = vigil.run("status", env={"COLUMNS": "80"}).stdout.splitlines()
    assert all(len(line) <= 80 for line in table), table
    at = next(i for i, line in enumerate(table) if line.startswith("paym"))
    assert table[at].split()[2] in BETWEEN, table  # whole, never cut
    rest = [line for line in table[at + 1:] if line.startswith(" ")]  # wrapped or under
    news = " ".join(" ".join([table[at], *rest]).split())
    assert "next " in news and "last #" in news, table
    assert "disabled, no run yet" in vigil.run("status", "off", env={"COLUMNS": "200"}).stdout

    shown = vigil.json("host", "show", name)
    assert shown["next_run"] and shown["last_run"]["state"] == "done", shown
    top = vigil.run("top").stdout.splitlines()
    (line,) = [ln for ln in top if ln.startswith(name)]
    assert line.split()[1] in BETWEEN and "last #" in line, top

    m = scrape(port)
    success = value(m, "vigil_job_last_success_timestamp", host=name)
    assert started.timestamp() - 1 < success <= utcnow().timestamp() + 1, success
    assert value(m, "vigil_job_runs_total", host=name, result="done") >= 1
    assert ("vigil_job_last_success_timestamp", frozenset({("host", "off")})) not in m
    assert value(m, "vigil_hosts", state="asleep") == 1  # off

    vigil.run("stop", name, "--wait", "--timeout", "60")
    st = vigil.json("status", name)[0]
    assert (st["state"], st["next_run"]) == ("asleep", None) and st["last_run"], st
    vigil.quiesce(30)
    vigil.check()


def report_job(v: Vigil, tmp: Path) -> None:
    """A job woken, with one run done: scheduled, next run in under an hour, last #1 done."""
    v.add_host("report", SCHEDULED_RUN, "--kind", "job", "--every", "1h", "--arg",
               str(tmp / "ran.txt"))
    agent(v)
    v.run("wake", "report")
    v.run("run", "report")
    wait_for(lambda: runs(v, "report")[0]["state"] == "done", 30, what="the run")


def test_the_pages_state_shows_a_job_as_top_does(vigil: Vigil, short_tmp: Path) -> None:
    report_job(vigil, short_tmp)
    ui, url = serve(vigil, "--listen", "127.0.0.1:0")
    try:
        status, body = get(url + "api/state")
        api, host = get(url + "api/v1/hosts/report")  # the HTTP API's row: status's
    finally:
        ended(ui)
    assert status == 200 and api == 200
    row = json.loads(host)
    assert row["state"] == "scheduled" and row["next_run"] and row["last_run"]["id"] == 1, row
    (cells,) = [c for c in json.loads(body)["hosts"] if c[0] == "report"]
    assert cells[1] == "scheduled", cells
    assert "next in " in cells[-1] and "last #1 done" in cells[-1], cells
    vigil.run("stop", "report", "--wait")
    vigil.quiesce(30)


def test_the_page_in_a_browser_shows_a_job(vigil: Vigil, short_tmp: Path,
                                           browser: object) -> None:  # noqa: F811
    report_job(vigil, short_tmp)
    ui, url = serve(vigil, "--listen", "127.0.0.1:0")
    try:
        page = browser.new_page()  # type: ignore[attr-defined]
        page.goto(url)
        row = page.locator("#hosts tbody tr", has_text="report")
        row.wait_for(timeout=15_000)
        assert row.locator("td").nth(1).text_content() == "scheduled"
        assert "last #1 done" in (row.text_content() or ""), row.text_content()
        assert row.locator("td.state-scheduled").count() == 1  # styled by its word
    finally:
        ended(ui)
    vigil.run("stop", "report", "--wait")
    vigil.quiesce(30)


def test_logs_of_one_run(vigil: Vigil, short_tmp: Path) -> None:
    script = short_tmp / "says.py"
    script.write_text(SAYS)
    vigil.add_host("say", Path(sys.executable), "--kind", "job", "--every", "1d",
                   "--arg", str(script), "--arg", "1")
    agent(vigil)
    first = int(vigil.run("run", "say").stdout.split("#")[1].split()[0])
    cp = vigil.run("run", "say")  # while the first is open: skipped, nothing of it runs
    assert cp.stdout.rstrip().endswith(": skipped"), cp.stdout
    skipped = int(cp.stdout.split("#")[1].split()[0])
    wait_for(lambda: runs(vigil, "say")[-1]["state"] == "done", 30, what="the first run")
    second = int(vigil.run("run", "say").stdout.split("#")[1].split()[0])
    wait_for(lambda: all(r["state"] in ("done", "skipped") for r in runs(vigil, "say")), 30,
             what="the second run")
    by_id = {r["id"]: r for r in runs(vigil, "say")}
    for run in (first, second):
        shown = vigil.run("logs", "say", "--run", str(run)).stdout.splitlines()
        gen = by_id[run]["generation"]
        assert shown == [f"g{gen} | run of {by_id[run]['scheduled_at']}"], shown
    for args, says in ((("say", "--run", str(skipped)), f"run #{skipped} of say is skipped"),
                       (("say", "--run", "999"), "say has no run #999"),
                       (("--all", "--run", str(first)), "--run names one job's run"),
                       (("nope", "--run", str(first)), "no host named 'nope'")):
        cp = vigil.run("logs", *args, check=False)
        assert cp.returncode != 0 and says in cp.stderr, cp.stderr
        assert len(cp.stderr.strip().splitlines()) == 1, cp.stderr
    vigil.quiesce(30)
    vigil.check()


def test_status_at_80_columns_never_cuts_a_jobs_state(vigil: Vigil) -> None:
    """No agent: a job woken is `scheduled` from the store alone, its next run computed."""
    long = "a-job-with-a-rather-long-name-to-squeeze-the-table"
    vigil.add_host(long, SCHEDULED_RUN, "--kind", "job", "--schedule", "*/5 * * * *",
                   "--arg", "/dev/null")
    vigil.run("wake", long)
    cp = subprocess.run([sys.executable, "-m", "runners.cli", "status"], capture_output=True,
                        text=True, env={**vigil.env, "COLUMNS": "80"}, cwd=ROOT, timeout=60)
    lines = cp.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert any(" scheduled " in f" {line} " for line in lines), lines
    st = vigil.json("status", long)[0]
    nxt = datetime.fromisoformat(st["next_run"].removesuffix("Z"))
    assert nxt.minute % 5 == 0 and nxt.second == 0 and nxt > utcnow(), st


def test_a_hosts_files_running_key_enables_and_disables_a_job(vigil: Vigil, short_tmp: Path) -> None:
    """`running = true` wakes a job once: scheduled, a second apply keeps it (it read
    `asleep` between runs before, and woke it again); `running = false` stops it."""
    f = short_tmp / "hosts.toml"
    text = (f'[hosts.report]\nbuild = "{SCHEDULED_RUN}"\nkind = "job"\nevery = "1h"\n'
            f'args = ["{short_tmp / "ran.txt"}"]\nrunning = true\n')
    f.write_text(text)
    out = vigil.run("apply", str(f)).stdout
    assert "wake report (running = true" in out, out
    assert vigil.json("status", "report")[0]["state"] == "scheduled"
    again = vigil.run("apply", str(f)).stdout
    assert "wake" not in again and "keep report" in again, again
    f.write_text(text.replace("running = true", "running = false"))
    out = vigil.run("apply", str(f)).stdout
    assert "stop report (running = false" in out, out
    st = vigil.json("status", "report")[0]  # no agent: the stop is owed, the schedule off
    assert (st["state"], st["desired"], st["next_run"]) == ("stopping", "down", None), st
