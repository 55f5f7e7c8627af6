"""What a real agent on a SQLite store imports, in its whole life (start, recovery, a wake, a
round, its stop) and before it says ready.

In its whole life: never SQLAlchemy's PostgreSQL dialect (its import cost about two
`python -c pass` of the start-up: the schema's PostgreSQL-only options are set only once a
PostgreSQL engine is made, models/tables.py postgresql_options) nor Alembic (no migration
is needed when the store is at head).

Before ready (its start-up, issue 42): only what recovery and the running agent need. Of the
CLI, click and `vigil agent`'s own module (runners/cli COMMANDS loads a command's module when
it is asked for); never rich (tables of other commands), the HTTP API and the page (`vigil
ui`), the importers (`vigil import`), prometheus_client (only with --metrics-listen), the
webhooks' urllib and http.client (at the first POST).

The agent runs as `python -m runners.cli agent` would, with a handler on its log writing the
names of the modules loaded at its `ready` line, and an atexit hook those loaded at its exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELLO, ROOT, Vigil

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.sqlite_only("what the agent imports on a SQLite store")]

# The agent's own entry point, with the names of its modules written at ready and at exit.
WRAPPER = """
import atexit, json, logging, runpy, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
class AtReady(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("ready "):
            open(out + ".ready", "w").write(json.dumps(sorted(sys.modules)))
logging.getLogger("vigil.agent").addHandler(AtReady())
sys.argv = ["vigil", "agent", "--safety-interval", "1"]
runpy.run_module("runners.cli", run_name="__main__", alter_sys=True)
"""


def test_what_an_agent_on_sqlite_imports(vigil: Vigil, tmp_path: Path) -> None:
    vigil.add_host("hello", HELLO)
    out = tmp_path / "modules.json"
    log = open(vigil.state_dir / "agent.out", "ab")
    agent = subprocess.Popen([sys.executable, "-c", WRAPPER, str(out)], env=vigil.env, cwd=ROOT,
                             stdout=log, stderr=log)
    log.close()
    vigil.agents.append(agent)  # ended by the fixture if the test fails before its stop
    vigil.wait_ready(agent)
    vigil.run("wake", "hello", "--wait")
    vigil.run("stop", "hello", "--wait")
    assert vigil.stop_agent(agent) == 0, vigil.agent_log().decode()[-3000:]
    modules = json.loads(out.read_text())
    assert "sqlalchemy.orm" in modules and "runners.agent.daemon" in modules  # the real agent
    unwanted = [m for m in modules if m.startswith(("sqlalchemy.dialects.postgresql", "psycopg",
                                                    "alembic"))]
    assert unwanted == []
    at_ready = json.loads((tmp_path / "modules.json.ready").read_text())
    assert "workflows.engine.recovery" in at_ready and "runners.agent.daemon" in at_ready
    cli = {m for m in at_ready if m.startswith("runners.cli.")}
    assert cli <= CLI_AT_READY, sorted(cli - CLI_AT_READY)
    early = [m for m in at_ready if any(m == p or m.startswith(p + ".") for p in NOT_AT_READY)]
    assert early == []


# The modules of runners/cli the agent has loaded when it says ready: its command and what
# that command's module imports (the options, the state dir and store's Env, their output).
CLI_AT_READY = {"runners.cli.agent", "runners.cli.common", "runners.cli.completion",
                "runners.cli.output", "runners.cli.retention"}
# Never loaded before ready: tables of other commands, the metrics server (no --metrics-listen
# here), the page's HTTP server, the importers, the webhooks' HTTP client (no notifier here).
NOT_AT_READY = ("rich", "prometheus_client", "runners.agent.metrics", "http.server",
                "runners.imports", "http.client", "urllib.request")
