"""The operator's view: the metrics endpoint scraped over real HTTP and parsed with
prometheus-client's own parser, JSON logs from a real agent, `events --follow` as a real
process, scheduled restarts through APScheduler's job store across an agent restart, and
the human tables."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from models.tables import Attempt
from runners.agent import jobstore
from tests.conftest import HELLO, ROOT, Vigil, wait_for
from tests.integration.test_cli_bad_input import dump, refused


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return m[(name, frozenset(labels.items()))]


def json_log(v: Vigil) -> list[dict[str, Any]]:
    return [json.loads(line) for line in v.agent_log().decode().splitlines() if line.strip()]


def test_metrics_and_json_logs(vigil: Vigil) -> None:
    vigil.add_host("hello")
    vigil.run("wake", "hello")
    vigil.env["VIGIL_SETTLE_SECONDS"] = "3"  # the canary's settle keeps its attempt open
    port = free_port()
    agent = vigil.start_agent(None, "--metrics-listen", f"127.0.0.1:{port}", "--log-format", "json")
    wait_for(lambda: agent.poll() is not None or any(
        e["msg"] == "ready" for e in json_log(vigil)), 30, what="agent ready (JSON log)")
    assert agent.poll() is None, vigil.agent_log().decode()[-3000:]
    wait_for(lambda: value(scrape(port), "vigil_hosts", state="awake") == 1, 30, what="awake")

    vigil.run("deploy", "hello", str(HELLO), "--canary")
    during = wait_for(lambda: (m := scrape(port)) and value(
        m, "vigil_hosts", state="deploying") == 1 and m, 30, what="deploying host scraped")
    assert value(during, "vigil_open_obligations", kind="attempt") == 1
    assert value(during, "vigil_oldest_obligation_age_seconds", kind="attempt") > 0
    assert value(during, "vigil_attempts_total", outcome="open") == 1
    after = wait_for(lambda: (m := scrape(port)) and value(
        m, "vigil_open_obligations", kind="attempt") == 0 and m, 60, what="attempt closed")
    assert value(after, "vigil_attempts_total", outcome="done") == 1
    assert value(after, "vigil_attempts_total", outcome="open") == 0
    assert value(after, "vigil_hosts", state="awake") == 1
    assert value(after, "vigil_deploy_duration_seconds_count") == 1
    assert value(after, "vigil_deploy_duration_seconds_sum") >= 3  # the settle window
    assert value(after, "vigil_drain_duration_seconds_count") == 1
    assert value(after, "vigil_reconciler_round_seconds_count") >= 1
    assert value(after, "vigil_proofs_failed_total") == 0

    # deploy --wait prints each step as it is reached, with the elapsed time.
    out = vigil.run("deploy", "hello", str(HELLO), "--wait").stdout
    steps = re.findall(r"^\s*\d+\.\d\ds  (\w+)$", out, re.M)
    assert steps[0] == "queued" and "switched" in steps and steps[-1] == "ended", out
    assert value(scrape(port), "vigil_attempts_total", outcome="done") == 2

    status = vigil.run("status").stdout
    assert re.search(r"hello .*awake .*g\d+ .* \d+s ", status), status
    assert "next try" in vigil.run("obligations").stdout

    vigil.stop_agent(agent)
    log = json_log(vigil)
    assert all({"ts", "level", "logger", "msg"} <= e.keys() for e in log)
    assert any(e["msg"] == "drive" and e.get("kind") == "attempt" and e.get("host") == "hello"
               and e.get("result") == "progress" for e in log), log


def test_metrics_listen_refused(vigil: Vigil) -> None:
    vigil.add_host("hello")
    before = dump(vigil)
    refused(vigil.run("agent", "--metrics-listen", "127.0.0.1:99999", check=False),
            "--metrics-listen", "ADDRESS:PORT")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused(vigil.run("agent", "--metrics-listen", f"127.0.0.1:{port}", check=False),
                "cannot serve metrics", "--metrics-listen")
    assert dump(vigil) == before


def test_schedule_misfire_is_coalesced_into_one_restart(vigil: Vigil) -> None:
    vigil.add_host("hello")
    before = dump(vigil)
    refused(vigil.run("schedule", "add", "hello", "--cron", "61 * * * *", check=False),
            "invalid cron expression", "--cron")
    refused(vigil.run("schedule", "add", "nope", "--cron", "* * * * *", check=False), "nope")
    refused(vigil.run("schedule", "rm", "hello", check=False), "no restart schedule")
    assert dump(vigil) == before

    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait")
    first = vigil.status("hello")["generation"]
    vigil.stop_agent(agent)  # the agent is down across the next fire times

    vigil.run("schedule", "add", "hello", "--cron", "* * * * *")
    refused(vigil.run("schedule", "add", "hello", "--cron", "0 4 * * *", check=False),
            "already has a restart schedule")
    # Four fire times pass while no agent runs: moved back through APScheduler's own API.
    with jobstore.opened(vigil.store) as scheduler:
        scheduler.modify_job(jobstore.job_id("hello"),
                             next_run_time=datetime.now(UTC) - timedelta(minutes=3, seconds=30))
    [job] = vigil.json("schedule", "list")
    assert job["cron"] == "* * * * *"
    assert datetime.fromisoformat(job["next_run"]) < datetime.now(UTC)  # listing ran nothing

    before_ready = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before_ready)

    def restarts() -> list[Attempt]:
        return vigil.store.read(lambda s: list(s.execute(
            select(Attempt).where(Attempt.host == "hello", Attempt.cause == "restart")).scalars()))

    wait_for(lambda: any(a.outcome is not None for a in restarts()), 60, what="restart attempt ended")
    [job] = vigil.json("schedule", "list")
    assert datetime.fromisoformat(job["next_run"]) > datetime.now(UTC)  # the missed runs are spent
    [restart] = restarts()  # ... and were coalesced into ONE restart
    assert (restart.outcome.value, restart.effective_mode.value, restart.executed) == \
        ("done", "overlap", True)
    assert vigil.status("hello")["generation"] not in (None, first)
    vigil.run("schedule", "rm", "hello")
    assert vigil.json("schedule", "list") == []
    vigil.quiesce()
    vigil.check()


def test_events_follow(vigil: Vigil) -> None:
    vigil.add_host("hello")
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "events", "hello", "--follow",
                          "--json"], env=vigil.env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: [lines.append(json.loads(x)) for x in p.stdout],  # type: ignore[union-attr]
                              daemon=True)
    reader.start()
    try:
        wait_for(lambda: [e["kind"] for e in lines] == ["host_added"], 30, what="the backlog")
        vigil.run("wake", "hello")  # no agent: the intent and its event are written
        wait_for(lambda: [e["kind"] for e in lines] == ["host_added", "wake_requested"], 30,
                 what="the new event followed")
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        reader.join(10)
        p.stdout.close()  # type: ignore[union-attr]
    text = vigil.run("events", "hello").stdout.splitlines()
    assert [line.split()[4] for line in text] == ["host_added", "wake_requested"], text
