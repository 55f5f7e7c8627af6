"""Jobs' policies (issue 40, items 4-5): on hosts, `overlap` (skip | queue | replace | allow,
"skip" for every host written before), `catch_up` (none | one | all, "one"),
`catch_up_window` (seconds, NULL: no bound), `run_timeout` (seconds, NULL: none) and
`run_retries` (0); on job_runs, the states `queued` (due while the run before it still runs,
overlap queue) and `missed` (passed while no agent ran and not run by the catch-up policy),
and `tries` (the run's starts after its first, for --retries).

The host columns are added in place; on SQLite their CHECKs are triggers, as 0039 does. The
new run states mean a new CHECK on job_runs: PostgreSQL swaps it in place, SQLite rebuilds
job_runs (no table names it), with the view dropped around the rebuild; the view's job_run branch counts `queued` runs
as owed. Downgrade turns
`queued` runs into `due` and `missed` ones into `skipped` before the old CHECK comes back.

Revision ID: 0041
Revises: 0040
"""
import sqlalchemy as sa
from alembic import op

revision = "0041"
down_revision = "0040"
branch_labels = None
depends_on = None

OLD_STATES = ("due", "running", "done", "failed", "skipped", "interrupted")
NEW_STATES = (*OLD_STATES, "queued", "missed")
STATE_CHECK = "ck_job_runs_run_state"
HOST_RULES = {
    "ck_hosts_overlap": ("overlap", "{p}overlap IN ('skip', 'queue', 'replace', 'allow')"),
    "ck_hosts_catch_up": ("catch_up", "{p}catch_up IN ('none', 'one', 'all')"),
}


def _view(branch_states: str) -> str:
    """The view with its job_run branch over `branch_states` (0040's: due, running; this
    revision's adds queued: a queued run is owed)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_v0040", Path(__file__).with_name("0040_jobs.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod._view_0039() + mod.VIEW_0040_BRANCH).replace("('due', 'running')", branch_states)


OPEN_0040 = "('due', 'running')"
OPEN_0041 = "('due', 'running', 'queued')"


def _states(values: tuple[str, ...]) -> str:
    return "state IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def _run_states(values: tuple[str, ...], *, add: bool) -> None:
    """The state CHECK of job_runs becomes `values`; `tries` is added (add) or dropped; the
    view is made again with the open states of that side."""
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f(STATE_CHECK), "job_runs", type_="check")
        op.create_check_constraint(op.f(STATE_CHECK), "job_runs", _states(values))
        if add:
            op.add_column("job_runs", sa.Column("tries", sa.Integer(), nullable=False,
                                                server_default="0"))
        else:
            op.drop_column("job_runs", "tries")
        op.execute(_view(OPEN_0041 if add else OPEN_0040))
        return
    with op.batch_alter_table("job_runs", recreate="always") as batch:
        batch.drop_constraint(op.f(STATE_CHECK), type_="check")
        batch.create_check_constraint(op.f(STATE_CHECK), _states(values))
        if add:
            batch.add_column(sa.Column("tries", sa.Integer(), nullable=False, server_default="0"))
        else:
            batch.drop_column("tries")
    op.execute(_view(OPEN_0041 if add else OPEN_0040))


def _host_checks(create: bool) -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name, (column, rule) in HOST_RULES.items():
        if not sqlite:
            if create:
                op.create_check_constraint(name, "hosts", rule.format(p=""))
            else:
                op.drop_constraint(name, "hosts", type_="check")
            continue
        if not create:
            op.execute(f"DROP TRIGGER IF EXISTS {name}_insert")
            op.execute(f"DROP TRIGGER IF EXISTS {name}_update")
            continue
        raise_ = f"SELECT RAISE(ABORT, 'CHECK constraint failed: {name}');"
        op.execute(f"CREATE TRIGGER {name}_insert BEFORE INSERT ON hosts "
                   f"WHEN NOT ({rule.format(p='NEW.')}) BEGIN {raise_} END")
        op.execute(f"CREATE TRIGGER {name}_update BEFORE UPDATE OF {column} ON hosts "
                   f"WHEN NOT ({rule.format(p='NEW.')}) BEGIN {raise_} END")


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("overlap", sa.String(length=8), nullable=False,
                                   server_default="skip"))
        batch.add_column(sa.Column("catch_up", sa.String(length=4), nullable=False,
                                   server_default="one"))
        batch.add_column(sa.Column("catch_up_window", sa.Float(), nullable=True))
        batch.add_column(sa.Column("run_timeout", sa.Float(), nullable=True))
        batch.add_column(sa.Column("run_retries", sa.Integer(), nullable=False,
                                   server_default="0"))
    _host_checks(create=True)
    _run_states(NEW_STATES, add=True)


def downgrade() -> None:
    op.execute("UPDATE job_runs SET state = 'due' WHERE state = 'queued'")
    op.execute("UPDATE job_runs SET state = 'skipped' WHERE state = 'missed'")
    _run_states(OLD_STATES, add=False)
    _host_checks(create=False)
    with op.batch_alter_table("hosts", recreate="never") as batch:
        for column in ("run_retries", "run_timeout", "catch_up_window", "catch_up", "overlap"):
            batch.drop_column(column)
