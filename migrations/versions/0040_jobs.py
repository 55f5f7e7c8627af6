"""Jobs on a schedule (issue 40, items 1-3): a job is stored as a worker whose schedule is
set: `hosts.every` (seconds) or `hosts.schedule` (a cron line), `hosts.timezone` and
`hosts.runs_from` (when its schedule was last enabled), all NULL for every host written
before; and the table `job_runs`, one row per run, unique per (host, scheduled instant),
open rows in pending_obligations.

A kind `job` in hosts.kind would mean a new CHECK, and on SQLite a rebuild of hosts (the
table every other one names): the job's schedule says it instead. The host columns are
added in place. The view is dropped and created again with its new branch; downgrade puts
0039's back (read from that revision, so the two stay one text).

Revision ID: 0040
Revises: 0039
"""
import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = "0040"
down_revision = "0039"
branch_labels = None
depends_on = None

STATES = ("due", "running", "done", "failed", "skipped", "interrupted")


def _view_0039() -> str:
    spec = importlib.util.spec_from_file_location("_v0039", Path(__file__).with_name("0039_reloads.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.VIEW_0039)


VIEW_0040_BRANCH = """UNION ALL
SELECT 'job_run', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM job_runs WHERE state IN ('due', 'running')
"""


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("every", sa.Float(), nullable=True))
        batch.add_column(sa.Column("schedule", sa.Text(), nullable=True))
        batch.add_column(sa.Column("timezone", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("runs_from", sa.DateTime(), nullable=True))
    op.create_table(
        "job_runs",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("host", sa.String(63), nullable=False),
        sa.Column("scheduled_at", sa.DateTime(), nullable=False),
        sa.Column("state", sa.Enum(*STATES, name="run_state", native_enum=False,
                                   create_constraint=True, length=16), nullable=False),
        sa.Column("cause", sa.String(16), nullable=False),
        sa.Column("wake_id", sa.Integer(), nullable=True),
        sa.Column("generation_id", sa.Integer(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("exit_status", sa.Integer(), nullable=True),
        sa.Column("duration", sa.Float(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("since", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], ondelete="CASCADE",
                                name=op.f("fk_job_runs_host_hosts")),
        sa.ForeignKeyConstraint(["generation_id"], ["generations.id"],
                                name=op.f("fk_job_runs_generation_id_generations")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_runs")),
        sa.UniqueConstraint("host", "scheduled_at", name="uq_job_runs_host_instant"))
    op.create_index(op.f("ix_job_runs_next_attempt_at"), "job_runs", ["next_attempt_at"])
    op.create_index(op.f("ix_job_runs_generation_id"), "job_runs", ["generation_id"])
    op.create_index(op.f("ix_job_runs_wake_id"), "job_runs", ["wake_id"])
    op.create_index("ix_job_runs_state_host", "job_runs", ["state", "host"])
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute(_view_0039() + VIEW_0040_BRANCH)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute(_view_0039())
    op.drop_table("job_runs")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("runs_from")
        batch.drop_column("timezone")
        batch.drop_column("schedule")
        batch.drop_column("every")
