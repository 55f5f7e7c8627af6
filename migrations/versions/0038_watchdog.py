"""The watchdog (issue 39, item 3): `hosts.watchdog` (seconds, NULL: none) and the table
`watchdogs`, one row per generation spawned with one: the period its WATCHDOG_USEC said,
the deadline by which a WATCHDOG=1 must have come (NULL until it runs), and when and why it
fired (the intent written before its SIGABRT).

The host column is added in place (no rebuild of hosts: on SQLite that would cascade-delete
every row that references a host); it is a duration bounded as every other: a CHECK on
PostgreSQL, two triggers on SQLite, as 0012 does for health_interval. A fired watchdog is
finished by the agent's watchdog loop (and at its start); it is not a pending obligation of
the reconciler, so the view is unchanged.

Revision ID: 0038
Revises: 0037
"""
import sqlalchemy as sa
from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None

NAME = "ck_hosts_watchdog"
RULE = "({c} IS NULL OR ({c} > 0 AND {c} <= 86400))"


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("watchdog", sa.Float(), nullable=True))
    op.create_table(
        "watchdogs",
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=63), nullable=False),
        sa.Column("period", sa.Float(), nullable=False),
        sa.Column("deadline", sa.DateTime(), nullable=True),
        sa.Column("fired_at", sa.DateTime(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.CheckConstraint("period > 0 AND period <= 86400", name=op.f("ck_watchdogs_period")),
        sa.ForeignKeyConstraint(["generation_id"], ["generations.id"], ondelete="CASCADE",
                                name=op.f("fk_watchdogs_generation_id_generations")),
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], ondelete="CASCADE",
                                name=op.f("fk_watchdogs_host_hosts")),
        sa.PrimaryKeyConstraint("generation_id", name=op.f("pk_watchdogs")))
    op.create_index(op.f("ix_watchdogs_host"), "watchdogs", ["host"])
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(op.f(NAME), "hosts", RULE.format(c="watchdog"))
        return
    raise_ = f"SELECT RAISE(ABORT, 'CHECK constraint failed: {NAME}');"
    rule = RULE.format(c="NEW.watchdog")
    op.execute(f"CREATE TRIGGER {NAME}_insert BEFORE INSERT ON hosts "
               f"WHEN NOT {rule} BEGIN {raise_} END")
    op.execute(f"CREATE TRIGGER {NAME}_update BEFORE UPDATE OF watchdog ON hosts "
               f"WHEN NOT {rule} BEGIN {raise_} END")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f(NAME), "hosts", type_="check")
    else:
        op.execute(f"DROP TRIGGER IF EXISTS {NAME}_insert")
        op.execute(f"DROP TRIGGER IF EXISTS {NAME}_update")
    op.drop_index(op.f("ix_watchdogs_host"), table_name="watchdogs")
    op.drop_table("watchdogs")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("watchdog")
