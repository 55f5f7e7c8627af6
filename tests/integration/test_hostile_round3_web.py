"""Issue 37, round three: the status page and the webhooks attacked over real sockets. The
page checks the Host header (DNS rebinding), warns of a token file others can read, refuses
a request body before reading it, cuts a header sent too slowly, and says in one line that
it cannot listen. A webhook that trickles bytes ends at its deadline and never holds the
slots a restart needs; a redirect is a failed try; a URL with a control character is
refused at `notify add`, and a delivery's own error is recorded as that error."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert

from models.store import utcnow
from models.tables import Notifier, NotifyOn
from tests.conftest import FIXTURES, ROOT, Vigil, wait_for
from tests.integration.test_cli_bad_input import dump, refused
from tests.integration.test_notifications import due_one, owe, tries
from workflows.base.context import Context, Result
from workflows.engine.obligations import Due, run_one

pytestmark = pytest.mark.timeout(240)


Answer = Callable[[socket.socket, threading.Event, str], None]  # a connection, stop, its head


class Receiver:
    """A raw TCP receiver on 127.0.0.1: each connection handed to `answer(conn, stop, head)` on a
    thread of its own; counts the connections open now and every request line seen."""

    def __init__(self, answer: Answer) -> None:
        self.answer, self.stop = answer, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)  # the accept loop looks at `stop` between waits
        self.port = self.sock.getsockname()[1]
        self.open = 0
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self.lock:
            self.open += 1
        try:
            with conn:
                head = _read_head(conn)
                with self.lock:
                    self.lines.append(head.split("\r\n", 1)[0])
                self.answer(conn, self.stop, head)
        except OSError:
            pass  # the client hung up: what a deadline does
        finally:
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def _read_head(conn: socket.socket) -> str:
    conn.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode("latin-1")


def trickle(conn: socket.socket, stop: threading.Event, _head: str) -> None:
    """A status line never finished: one byte every 0.2 s, well within any read timeout."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not stop.wait(0.2):
        conn.sendall(b"a")


def redirect(conn: socket.socket, _stop: threading.Event, head: str) -> None:
    """The POST is sent elsewhere, where a GET is answered 200."""
    if not head.startswith("POST"):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return
    conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: /landing\r\nContent-Length: 0\r\n"
                 b"Connection: close\r\n\r\n")


@pytest.fixture
def receivers() -> Iterator[Callable[[Answer], Receiver]]:
    made: list[Receiver] = []

    def make(answer: Answer) -> Receiver:
        made.append(Receiver(answer))
        return made[-1]

    yield make
    for r in made:
        r.close()


# -- 11. a redirect is a failed try -----------------------------------------------------------

def test_a_webhook_redirect_is_a_failed_try(vigil: Vigil, ctx: Context, receivers: Any) -> None:
    hook = receivers(redirect)
    vigil.run("notify", "add", "hook", "--on", "down", "--webhook",
              f"http://127.0.0.1:{hook.port}/vigil")
    owe(ctx, "down")
    assert run_one(ctx, due_one(ctx))[0] is Result.poked
    (t,) = tries(vigil)
    assert (t["outcome"], t["status"]) == ("failed", 302), t
    assert "redirect" in t["error"] and "/landing" in t["error"], t
    assert hook.lines == ["POST /vigil HTTP/1.1"], hook.lines  # not followed
    assert [o["kind"] for o in vigil.obligations()] == ["notification"]  # still owed


# -- 12. a control character in --webhook -----------------------------------------------------

def test_a_control_character_in_a_webhook_is_refused_at_add(vigil: Vigil) -> None:
    before = dump(vigil)
    for url in ("http://127.0.0.1:9/a\r\nX-Evil: 1", "http://127.0.0.1:9/a\nb",
                "http://127.0.0.1:9/a\tb", "http://127.0.0.1:9/a\x00", "http://127.0.0.1:9/a b"):
        refused(vigil.run("notify", "add", "bad", "--on", "down", "--webhook", url, check=False),
                "--webhook", "control character or space")
    assert dump(vigil) == before


def test_a_deliverys_own_error_is_recorded_as_that_error(vigil: Vigil, ctx: Context) -> None:
    """A notifier written before add refused such URLs: each try fails with its own error,
    never left open to be closed as `interrupted` by the next drive."""
    vigil.store.write(lambda s: (
        s.execute(insert(Notifier).values(name="old", webhook="http://127.0.0.1:9/a\r\nX: 1",
                                          timeout=2.0, created_at=utcnow())),
        s.execute(insert(NotifyOn).values(notifier="old", word="down"))))
    owe(ctx, "down")
    d = due_one(ctx)
    for _ in range(2):  # the second as if its backoff had passed
        assert run_one(ctx, Due("notification", d.id, d.host, utcnow(), 1))[0] is Result.poked
    got = tries(vigil)
    assert [t["outcome"] for t in got] == ["failed", "failed"], got
    assert all("agent ended" not in (t["error"] or "") for t in got), got
    assert "control character" in got[0]["error"], got


# -- 7. a trickling webhook: a deadline for the whole try, and slots of its own --------------

def test_a_trickling_webhook_ends_at_its_timeout(vigil: Vigil, ctx: Context,
                                                 receivers: Any) -> None:
    hook = receivers(trickle)
    vigil.run("notify", "add", "slow", "--on", "down", "--timeout", "2", "--webhook",
              f"http://127.0.0.1:{hook.port}/")
    owe(ctx, "down")
    done: list[Result] = []
    drive = threading.Thread(target=lambda: done.append(run_one(ctx, due_one(ctx))[0]),
                             daemon=True)
    drive.start()
    drive.join(3 * 2)  # it ends at its 2 s: 3x that is room for a loaded box
    alive = drive.is_alive()
    hook.close()  # ends a try that ignored its deadline, so the thread does not outlive us
    drive.join(10)
    assert not alive, "the try outlived 3x its timeout"
    (t,) = tries(vigil)
    assert t["outcome"] == "timeout" and "2s" in t["error"], t
    assert done == [Result.poked]


def test_trickling_webhooks_do_not_hold_the_slots_a_restart_needs(
        vigil: Vigil, receivers: Any) -> None:
    """9 notifiers (one more than the agent's 8 drive slots) trickle their answer for up to
    20 s each; an app killed meanwhile is restarted while they are still in flight."""
    hook = receivers(trickle)
    for i in range(9):
        vigil.run("notify", "add", f"slow{i}", "--on", "failed", "--timeout", "20",
                  "--webhook", f"http://127.0.0.1:{hook.port}/{i}")
    vigil.add_host("web")
    vigil.add_host("bad", FIXTURES / "exit_fast.py", "--health-timeout", "1")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    first = vigil.status("web")["pid"]
    vigil.run("wake", "bad", check=False)  # its wake_failed owes each notifier a delivery
    wait_for(lambda: hook.open >= 4, 20, what="deliveries in flight at the receiver")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: (p := vigil.status("web")["pid"]) and p != first and hook.open >= 4, 15,
             what="web restarted while the deliveries trickle")
    hook.close()  # the tries in flight end now
    assert vigil.stop_agent(agent) == 0


# -- 4. the page checks the Host header; a token file others can read is warned of -------------

def _start_ui(v: Vigil, *args: str) -> tuple[subprocess.Popen[str], list[str], int]:
    """`vigil ui` as a process: its lines up to the serving one, and its port."""
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "ui", *args], env=v.env,
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    lines: list[str] = []
    while not lines or "vigil ui: serving" not in lines[-1]:
        line = p.stdout.readline()
        assert line, f"vigil ui ended: {lines}"
        lines.append(line.rstrip("\n"))
    return p, lines, int(lines[-1].split(" on ")[1].split()[0].rstrip("/").rsplit(":", 1)[1])


def _end_ui(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait(10)
    if p.stdout is not None:
        p.stdout.close()


def _get(port: int, path: str, host: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host)
        conn.endheaders()
        answer = conn.getresponse()
        answer.read()
        return answer.status
    finally:
        conn.close()


def test_the_page_answers_only_its_own_host_names(vigil: Vigil) -> None:
    vigil.add_host("hello")
    ui, _, port = _start_ui(vigil, "--listen", "127.0.0.1:0")
    try:
        for name in ("127.0.0.1", "localhost", "[::1]"):
            assert _get(port, "/api/state", f"{name}:{port}") == 200, name
        for bad in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", ""):
            assert _get(port, "/api/state", bad) in (403, 421), bad
            assert _get(port, "/", bad) in (403, 421), bad
    finally:
        _end_ui(ui)
    ui, _, port = _start_ui(vigil, "--listen", "127.0.0.1:0", "--allow-host", "vigil.test")
    try:
        assert _get(port, "/api/state", f"vigil.test:{port}") == 200
        assert _get(port, "/api/state", f"evil.example:{port}") in (403, 421)
    finally:
        _end_ui(ui)


def test_a_token_file_others_can_read_is_warned_of(vigil: Vigil, short_tmp: Path) -> None:
    token = short_tmp / "token"
    token.write_text("0123456789abcdef0123\n")
    for mode, warned in ((0o644, True), (0o600, False)):
        token.chmod(mode)
        ui, lines, _ = _start_ui(vigil, "--listen", "127.0.0.1:0", "--token-file", str(token))
        _end_ui(ui)
        said = [line for line in lines if "readable by others" in line]
        assert len(said) == (1 if warned else 0), (oct(mode), lines)
        if warned:
            assert str(token) in said[0] and "chmod 600" in said[0], said


# -- 8. no request body, a bounded header time --------------------------------------------------

def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


def test_a_request_body_is_refused_before_it_is_read(vigil: Vigil) -> None:
    ui, _, port = _start_ui(vigil, "--listen", "127.0.0.1:0")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                      "Content-Length: 1000000000\r\n\r\nabc".encode())
            answer = s.recv(4096).decode("latin-1")  # at once: the body is never awaited
        assert answer.split(" ", 2)[1] == "413", answer
    finally:
        _end_ui(ui)


def test_a_header_sent_too_slowly_is_cut(vigil: Vigil) -> None:
    """One connection idle mid-header, one sending a byte every 0.5 s: both are closed by
    the page well before waitress's defaults (120 s idle, no bound at all on trickling)."""
    ui, _, port = _start_ui(vigil, "--listen", "127.0.0.1:0")
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        slow = socket.create_connection(("127.0.0.1", port), timeout=0.5)
        with idle, slow:
            idle.sendall(b"GET / HTTP/1.1\r\nX-A: ")
            slow.sendall(b"GET / HTTP/1.1\r\nX-B: ")
            started = time.monotonic()

            def both_cut() -> bool:
                try:
                    slow.sendall(b"b")
                except OSError:
                    return _closed_by_server(idle)
                return False

            wait_for(both_cut, 45, interval=0.01, what="the slow headers cut")
            assert time.monotonic() - started < 45
        assert _get(port, "/", f"127.0.0.1:{port}") == 200  # the page still answers
    finally:
        _end_ui(ui)


# -- 14. `vigil ui` that cannot listen: one line --------------------------------------------------

def test_ui_that_cannot_listen_says_so_in_one_line(vigil: Vigil, short_tmp: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        cp = vigil.run("ui", "--listen", f"127.0.0.1:{port}", check=False, subprocess=True,
                       timeout=30)
        refused(cp, f"127.0.0.1:{port}", "in use")
    cp = vigil.run("ui", "--listen", f"unix:{short_tmp}/absent/ui.sock", check=False,
                   subprocess=True, timeout=30)
    refused(cp, "absent/ui.sock", "No such file or directory")
