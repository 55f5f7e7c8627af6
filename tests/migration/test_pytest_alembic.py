"""pytest-alembic's own checks, run against vigil's migrations on the database under test
(tests/conftest.py `--db sqlite|postgresql`): its built-in tests (one head, upgrade to
head, the models equal the migrated DDL, every revision down and up again) and two of its
experimental ones (a downgrade leaves no trace of its upgrade; every model registers on
the metadata env.py imports).

Its fixtures follow the plugin's convention: `alembic_engine` yields an Engine, which
reaches migrations/env.py in `config.attributes["connection"]` (env.py takes an Engine or
a Connection there)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_alembic import tests as builtin
from pytest_alembic.config import Config
from pytest_alembic.tests import experimental
from sqlalchemy import Engine

from models import schema
from models.statedir import prepare_state_dir
from models.store import Store
from models.tables import Base
from tests.conftest import drop_db, new_db

pytestmark = pytest.mark.backend("the migrations, per dialect")


@pytest.fixture
def alembic_engine(tmp_path: Path) -> Iterator[Engine]:
    """An empty database (a SQLite file or a throwaway PostgreSQL database) behind vigil's
    own engine: its pragmas, its IMMEDIATE write transactions."""
    store = Store(new_db(prepare_state_dir(tmp_path / "state")))
    try:
        yield store.engine
    finally:
        store.dispose()
        drop_db(store.url)


@pytest.fixture
def alembic_config(alembic_engine: Engine) -> Config:
    return Config.from_raw_config(schema.alembic_config(
        alembic_engine.url.render_as_string(hide_password=False)))


def test_single_head_revision(alembic_runner) -> None:  # type: ignore[no-untyped-def]
    builtin.test_single_head_revision(alembic_runner)


def test_upgrade(alembic_runner) -> None:  # type: ignore[no-untyped-def]
    builtin.test_upgrade(alembic_runner)


def test_model_definitions_match_ddl(alembic_runner) -> None:  # type: ignore[no-untyped-def]
    builtin.test_model_definitions_match_ddl(alembic_runner)


def test_up_down_consistency(alembic_runner) -> None:  # type: ignore[no-untyped-def]
    builtin.test_up_down_consistency(alembic_runner)


def test_downgrade_leaves_no_trace(alembic_runner) -> None:  # type: ignore[no-untyped-def]
    experimental.test_downgrade_leaves_no_trace(alembic_runner)


def test_all_models_register_on_metadata(alembic_runner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The tables env.py's bare import registers (read in a clean interpreter) equal those
    registered once every module of the `models` package is imported. The test looks for
    the metadata in the package's own namespace; vigil keeps it in models/tables.py (the
    package's __init__ imports nothing, so a light client can import models.errors), so
    the test is told where it is."""
    import models

    monkeypatch.setattr(models, "metadata", Base.metadata, raising=False)
    experimental.test_all_models_register_on_metadata(alembic_runner, "models")
