"""The ongoing health probe of an instance (issue 16 item 5): how often to probe, after how
many failures in a row the generation counts as unhealthy, and whether it is then restarted;
on the generation, the failures in a row and since when it is unhealthy.

Columns are added by ALTER TABLE ADD COLUMN (no rebuild of `hosts`: on SQLite that would
cascade-delete every row that references a host). `health_interval` is a duration bounded
as every other (finite, above 0, at most a day): a CHECK on PostgreSQL, two triggers on
SQLite, as in 0006.

Revision ID: 0012
Revises: 0011
"""
import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

NAME = "ck_hosts_health_interval"
RULE = "({c} IS NULL OR ({c} > 0 AND {c} <= 86400))"


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("health_interval", sa.Float(), nullable=True))
        batch.add_column(sa.Column("unhealthy_after", sa.Integer(), nullable=False,
                                   server_default="3"))
        batch.add_column(sa.Column("unhealthy_restart", sa.Boolean(), nullable=False,
                                   server_default=sa.text("false")))
    with op.batch_alter_table("generations", recreate="never") as batch:
        batch.add_column(sa.Column("health_failures", sa.Integer(), nullable=False,
                                   server_default="0"))
        batch.add_column(sa.Column("unhealthy_since", sa.DateTime(), nullable=True))
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(op.f(NAME), "hosts", RULE.format(c="health_interval"))
        return
    raise_ = f"SELECT RAISE(ABORT, 'CHECK constraint failed: {NAME}');"
    rule = RULE.format(c="NEW.health_interval")
    op.execute(f"CREATE TRIGGER {NAME}_insert BEFORE INSERT ON hosts "
               f"WHEN NOT {rule} BEGIN {raise_} END")
    op.execute(f"CREATE TRIGGER {NAME}_update BEFORE UPDATE OF health_interval ON hosts "
               f"WHEN NOT {rule} BEGIN {raise_} END")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f(NAME), "hosts", type_="check")
    else:
        op.execute(f"DROP TRIGGER IF EXISTS {NAME}_insert")
        op.execute(f"DROP TRIGGER IF EXISTS {NAME}_update")
    with op.batch_alter_table("generations", recreate="never") as batch:
        batch.drop_column("unhealthy_since")
        batch.drop_column("health_failures")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("unhealthy_restart")
        batch.drop_column("unhealthy_after")
        batch.drop_column("health_interval")
