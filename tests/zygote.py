"""The test harness's agent starter: one process per test run that has imported everything
an agent runs (click, SQLAlchemy's ORM, APScheduler, every workflow) and forks a new agent
for each request, so a test's agent is ready without ~0.8 s of interpreter start-up and
imports (several hundred agents a run: the crash matrix alone starts three a scenario).

The child is what `python -m runners.cli agent ...` runs, minus the imports: the request's
environment, working dir, argv and log file (its stdout and stderr), a fresh random seed,
and at its end the interpreter's own exit (non-daemon threads joined, atexit handlers
run). It differs from a console start in its command line (this module's) and in
/proc/<pid>/environ (the starter's): a test that reads either uses `real=True`
(tests/conftest.py Vigil.start_agent), as do the tests of the console start itself.

Protocol, over a unix socket, one connection an agent: the test sends one JSON line
{argv, env, cwd, log}; the starter answers `<pid>\\n` once forked, then `<wait status>\\n`
when the agent has ended (the starter is its parent and reaps it), and closes.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import traceback

PRELOAD = ("runners.cli", "runners.cli.agent", "runners.agent.daemon", "runners.wiring",
           "sqlalchemy.orm", "apscheduler.schedulers.background")


def preload(dialect: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    from runners.base.workflows import every_workflow

    every_workflow()
    if dialect == "postgresql":  # a SQLite agent never imports it (test_agent_imports)
        importlib.import_module("sqlalchemy.dialects.postgresql.psycopg")


def child(request: dict, keep_closed: list[int]) -> None:
    """In the forked child: become the requested agent, run it, exit as Python would."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in keep_closed:
        os.close(fd)
    os.chdir(request["cwd"])
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["vigil", *request["argv"]]
    random.seed()
    code = 0
    try:
        from runners.cli import main

        main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: B036 - as the interpreter would: printed, exit 1
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # as at interpreter exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve(srv: socket.socket, parent: int) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}  # agent pid -> its test's connection
    while os.getppid() == parent:  # the test run has ended: so does this
        ready, _, _ = select.select([srv, wake_r], [], [], 1.0)
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        reap(waiting)
        if srv in ready:
            conn, _ = srv.accept()
            request = json.loads(conn.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:
                child(request, [srv.fileno(), conn.fileno(), wake_r, wake_w,
                                *(c.fileno() for c in waiting.values())])
            waiting[pid] = conn
            conn.sendall(f"{pid}\n".encode())
            reap(waiting)


def reap(waiting: dict[int, socket.socket]) -> None:
    """Tell each ended agent's test its wait status."""
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{status}\n".encode())
            except OSError:
                pass
            conn.close()


if __name__ == "__main__":
    preload(sys.argv[2])
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(sys.argv[1])
    listening.listen(64)
    print("ready", flush=True)
    serve(listening, os.getppid())
