"""--listen-db (VIGIL_LISTEN_DB): the direct URL of the agent's LISTEN session when --db is a
pooler in transaction mode. What it switches (no prepared statements, no session SET) and
how a value that does not fit is refused: one line, nothing changed. (Through a real
PgBouncer: tests/multibox/test_pooler.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from models.errors import BadInput
from models.store import PREPARE_THRESHOLD, Store
from models.urls import listen_url_for
from tests.conftest import Vigil

pytestmark = pytest.mark.backend("the store's wake-ups: LISTEN or SQLite's poll")

PG = "postgresql://vigil@pooler:6432/vigil"
DIRECT = "postgresql://vigil@db1:5432/vigil"


def test_listen_url_is_postgresql_beside_a_postgresql_store() -> None:
    assert listen_url_for(PG, None) is None
    assert listen_url_for("postgresql+psycopg://vigil@pooler:6432/vigil", DIRECT) == \
        "postgresql+psycopg://vigil@db1:5432/vigil"
    with pytest.raises(BadInput, match="is for a PostgreSQL store .* the store is sqlite") as e:
        listen_url_for("sqlite:////s/vigil.db", DIRECT)
    assert "direct postgresql:// URL" in e.value.line()
    with pytest.raises(BadInput, match="is not a PostgreSQL URL"):
        listen_url_for(PG, "mysql://vigil@db1/vigil")
    with pytest.raises(BadInput, match="cannot parse the --listen-db URL"):
        listen_url_for(PG, "not a url")


def connect_params(store: Store) -> dict[str, Any]:
    """What the engine would pass psycopg for a new connection (no connection is made)."""
    cparams: dict[str, Any] = {}
    store.engine.dialect.dispatch.do_connect(store.engine.dialect, None, [], cparams)
    return cparams


def test_a_pooled_store_prepares_nothing_and_a_direct_agent_does() -> None:
    pooled, direct = Store(PG, listen_url=DIRECT), Store(PG)
    try:
        assert pooled.pooled and pooled.listen_url and not direct.pooled
        # A command prepares nothing either way (it seldom runs a statement 5 times).
        assert connect_params(pooled)["prepare_threshold"] is None
        assert connect_params(direct)["prepare_threshold"] is None
        for st in (pooled, direct):
            st.name_connections("vigil-box1")  # what the agent does
        assert connect_params(pooled) == {"application_name": "vigil-box1-store",
                                          "prepare_threshold": None}
        assert connect_params(direct)["prepare_threshold"] == PREPARE_THRESHOLD
    finally:
        pooled.dispose()
        direct.dispose()


def test_a_listen_db_that_does_not_fit_is_refused_in_one_line(vigil: Vigil) -> None:
    bad = "mysql://vigil@db1/vigil" if vigil.db_url else DIRECT  # on SQLite: any at all
    cp = vigil.run("--listen-db", bad, "host", "add", "web", "--build", str(vigil.state_dir),
                   check=False)
    assert cp.returncode != 0
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vigil: error: --listen-db"), cp.stderr
    assert vigil.json("host", "list") == []  # nothing was written
