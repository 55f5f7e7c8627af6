"""Notifications, in-process where a real agent adds nothing: a notifier refused in one line
with nothing changed; an event owes a delivery in its own transaction, shown in
pending_obligations; a command receives the event on stdin, fails, is retried with its
backoff written on the row, and is killed by pid past its timeout; a webhook on a real local
HTTP server is POSTed the event; `vigil notify log` shows every try. One real agent
delivers an event it wrote itself (a failed wake)."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from models.notices import word_of
from models.store import emit, utcnow
from models.tables import Delivery, Event
from tests.conftest import FIXTURES, Vigil, pid_dead, wait_for
from tests.integration.test_cli_bad_input import dump, refused
from workflows.base.context import Context, Result
from workflows.engine import history
from workflows.engine.obligations import Due, due, run_one

KNOWN = ("failed, down, oom, crashloop, unhealthy, listener_lost, rollout_halted, exited, restarted, "
         "reload_failed, run_failed, run_missed, run_late")
RECEIVER = """import json, os, sys
event = json.load(sys.stdin)
flag = sys.argv[1] + ".fail"
if os.path.exists(flag):  # fail once, saying why on stderr
    os.remove(flag)
    print("not now", file=sys.stderr)
    sys.exit(3)
with open(sys.argv[1], "a") as f:
    f.write(f"{event['id']} {event['kind']} {os.environ['VIGIL_EVENT_ID']}\\n")
"""


def receiver(tmp: Path) -> tuple[str, Path]:
    script, got = tmp / "receiver.py", tmp / "received"
    script.write_text(RECEIVER)
    return f"{sys.executable} {script} {got}", got


def owe(ctx: Context, kind: str = "down", host: str | None = "web", **detail: Any) -> int:
    """Write an event as a transition does; its id."""
    def step(s: Any) -> int:
        emit(s, kind, host, None, reason="test", **detail)
        return int(s.execute(select(func.max(Event.id))).scalar())

    return ctx.store.write(step)


def due_one(ctx: Context) -> Due:
    (d,) = [d for d in due(ctx, utcnow()) if d.kind == "notification"]
    return d


def tries(vigil: Vigil) -> list[dict[str, Any]]:
    return json.loads(vigil.run("notify", "log", "--json").stdout)


def test_refusals_change_nothing(vigil: Vigil) -> None:
    vigil.run("notify", "add", "kept", "--on", "down", "--exec", "true")
    before = dump(vigil)
    cases = [
        (("bad", "--on", "failed,exploded", "--exec", "true"), ("unknown --on word 'exploded'", KNOWN)),
        (("bad", "--on", "failed"), ("exactly one of --exec CMD and --webhook URL",)),
        (("bad", "--on", "failed", "--exec", "true", "--webhook", "http://127.0.0.1:9/"),
         ("exactly one of",)),
        (("bad", "--on", "failed", "--webhook", "ftp://example.com/"), ("not an http:// or https:// URL",)),
        (("bad", "--on", "failed", "--exec", "true", "--timeout", "60"), ("--timeout 60",)),
        (("Bad_Name", "--on", "failed", "--exec", "true"), ("invalid notifier name",)),
        (("kept", "--on", "failed", "--exec", "true"), ("notifier kept exists",)),
    ]
    for args, words in cases:
        refused(vigil.run("notify", "add", *args, check=False), *words)
    refused(vigil.run("notify", "remove", "absent", check=False), "no notifier absent")
    assert dump(vigil) == before


def test_words_map_events() -> None:
    assert word_of("wake_failed", {}) == word_of("deploy_failed", {}) == "failed"
    assert word_of("oom_killed", {}) == "oom"
    assert word_of("restart_scheduled", {"streak": 2}) == "crashloop"  # the one that begins it
    assert word_of("restart_scheduled", {"streak": 3}) is None
    assert word_of("reload_failed", {"answer": "keep"}) == "reload_failed"
    assert word_of("run_ended", {"result": "failed"}) == "run_failed"
    assert word_of("run_ended", {"result": "interrupted"}) == "run_failed"
    assert word_of("run_ended", {"result": "done"}) is None  # a run done is no news
    assert word_of("run_missed", {}) == "run_missed" and word_of("run_late", {}) == "run_late"
    assert word_of("run_skipped", {}) is None  # the overlap policy asked for it
    assert word_of("woke", {}) is None


def test_exec_delivery_retried_then_logged(vigil: Vigil, ctx: Context, short_tmp: Path) -> None:
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "down,oom", "--exec", command)
    owe(ctx, "woke")  # concerns no notifier
    event = owe(ctx, "down", attempt=7)
    assert [(o["kind"], o["host"]) for o in vigil.obligations()] == [("notification", "notify pager")]
    # `vigil check` counts it as open (no agent runs here: that much it says).
    said = json.loads(vigil.run("check", "--json", check=False).stdout)
    assert [v["name"] for v in said] == ["agent_alive"], said
    Path(f"{got}.fail").touch()

    first = due_one(ctx)
    tried_at = utcnow()
    assert run_one(ctx, first)[0] is Result.poked
    row = ctx.store.read(lambda s: s.get(Delivery, first.id))
    assert row.attempts == 1 and row.next_attempt_at > tried_at, row  # its backoff, on the row
    assert "exited 3: not now" in (row.last_error or ""), row.last_error
    # Asked at the last instant of its backoff, not at "now": a backoff of 0.1 s is over by
    # the time a loaded box runs the next line (it failed so once).
    assert not due(ctx, row.next_attempt_at - timedelta(milliseconds=1)), "due again only after its backoff"
    assert due(ctx, row.next_attempt_at)

    assert run_one(ctx, Due("notification", first.id, first.host, utcnow(), 1))[0] is Result.progress
    assert got.read_text().split() == [str(event), "down", str(event)]
    assert vigil.obligations() == []
    log = tries(vigil)
    assert [(t["outcome"], t["status"], t["event"]) for t in log] == [
        ("failed", 3, event), ("delivered", 0, event)]
    assert "not now" in log[0]["error"]
    shown = vigil.run("notify", "log").stdout
    assert "failed" in shown and "delivered" in shown and f"#{event} down web" in shown
    assert "pager" in vigil.run("notify", "list").stdout


def test_exec_killed_by_pid_past_its_timeout(vigil: Vigil, ctx: Context, short_tmp: Path) -> None:
    pidfile = short_tmp / "pid"
    vigil.run("notify", "add", "slow", "--on", "oom", "--timeout", "0.5",
              "--exec", f"echo $$ > {pidfile}; exec sleep 60")
    owe(ctx, "oom_killed")
    assert run_one(ctx, due_one(ctx))[0] is Result.poked
    pid = int(pidfile.read_text())
    assert pid_dead(pid), f"the command (pid {pid}) outlived its timeout"
    (t,) = tries(vigil)
    assert t["outcome"] == "timeout" and f"killed (pid {pid})" in t["error"], t
    assert [o["kind"] for o in vigil.obligations()] == ["notification"]  # still owed


class Hook(BaseHTTPRequestHandler):
    """Records each POST; answers 503 to the first, 204 after."""

    seen: list[tuple[dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((dict(self.headers), body))
        self.send_response(503 if len(self.seen) == 1 else 204)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def hook() -> Iterator[ThreadingHTTPServer]:
    Hook.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_webhook_posts_the_event(vigil: Vigil, ctx: Context, hook: ThreadingHTTPServer) -> None:
    url = f"http://127.0.0.1:{hook.server_address[1]}/vigil"
    vigil.run("notify", "add", "hook", "--on", "rollout_halted", "--webhook", url)
    event = owe(ctx, "rollout_halted", None, rollout=4)
    d = due_one(ctx)
    assert d.host == "notify hook"
    assert run_one(ctx, d)[0] is Result.poked
    assert run_one(ctx, Due("notification", d.id, d.host, utcnow(), 1))[0] is Result.progress
    assert len(Hook.seen) == 2
    headers, body = Hook.seen[1]
    sent = json.loads(body)
    assert (sent["id"], sent["kind"], sent["on"], sent["host"], sent["detail"]["rollout"]) == (
        event, "rollout_halted", "rollout_halted", None, 4)
    assert headers["X-Vigil-Event-Id"] == str(event) and headers["Content-Type"] == "application/json"
    assert [(t["outcome"], t["status"]) for t in tries(vigil)] == [("failed", 503), ("delivered", 204)]
    assert vigil.obligations() == []


def test_history_prunes_what_was_delivered(vigil: Vigil, ctx: Context, short_tmp: Path) -> None:
    command, _ = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "down", "--exec", command)
    owe(ctx, "down")
    assert run_one(ctx, due_one(ctx))[0] is Result.progress
    owe(ctx, "down")  # owed, never tried
    done = history.prune(ctx.store, history.Keep(older_than=timedelta(0)))
    assert (done["delivery_tries"], done["deliveries"]) == (1, 1), done
    assert [o["kind"] for o in vigil.obligations()] == ["notification"]  # the owed one stays


def test_remove_drops_what_is_owed(vigil: Vigil, ctx: Context) -> None:
    vigil.run("notify", "add", "pager", "--on", "down", "--webhook", "http://127.0.0.1:9/")
    owe(ctx, "down")
    out = vigil.run("notify", "remove", "pager").stdout
    assert "1 undelivered dropped" in out, out
    assert vigil.obligations() == []


def test_agent_delivers_the_events_it_writes(vigil: Vigil, short_tmp: Path) -> None:
    """A real agent: a wake whose build exits at once fails; its wake_failed reaches the
    receiver as `failed`."""
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "failed", "--exec", command)
    vigil.add_host("bad", FIXTURES / "exit_fast.py", "--health-timeout", "1")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "bad", check=False)
    wait_for(lambda: got.exists() and "wake_failed" in got.read_text(), 20,
             what="the failed wake's notification")
    vigil.quiesce(20)
    assert vigil.stop_agent(agent) == 0
    assert all(t["outcome"] == "delivered" for t in tries(vigil)), tries(vigil)
