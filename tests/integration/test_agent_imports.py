"""What a real agent on a SQLite store imports in its whole life (start, recovery, a wake, a
round, its stop): never SQLAlchemy's PostgreSQL dialect (its import cost about two
`python -c pass` of the start-up: the schema's PostgreSQL-only options are set only once a
PostgreSQL engine is made, models/tables.py postgresql_options) nor Alembic (no migration
is needed when the store is at head). The agent runs as `python -m runners.cli agent`
would, with an atexit hook writing the names of the modules it had loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HELLO, ROOT, Vigil

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.sqlite_only("what the agent imports on a SQLite store")]

# The agent's own entry point, with the names of its modules written when it exits.
WRAPPER = """
import atexit, json, runpy, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["vigil", "agent", "--safety-interval", "1"]
runpy.run_module("runners.cli", run_name="__main__", alter_sys=True)
"""


def test_an_agent_on_sqlite_never_imports_the_postgresql_dialect_nor_alembic(vigil: Vigil,
                                                                            tmp_path: Path) -> None:
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
