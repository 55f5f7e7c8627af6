"""Running an app the way production needs (issue 21): the user and group a host's
generations run as, its env files, the limits set on each generation's cgroup and the
credentials (name -> path) copied in at each start; on the generation, the user it was
spawned as (written before the spawn, so the termination proof knows whose processes may
carry its marker even when its pid was never recorded).

Every column is nullable or has a server default, so rows written before keep working: a
host without them runs as the agent's user, with no env file and no limit, as before.
Columns are added by ALTER TABLE ADD COLUMN (no rebuild of `hosts`: on SQLite that would
cascade-delete every row that references a host).

Revision ID: 0018
Revises: 0017
"""
import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

HOST_COLUMNS = ("run_user", "run_group", "env_files", "memory_max", "cpu_quota", "pids_max",
                "limit_nofile", "credentials")


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("run_user", sa.String(32), nullable=True))
        batch.add_column(sa.Column("run_group", sa.String(32), nullable=True))
        batch.add_column(sa.Column("env_files", sa.Text(), nullable=False, server_default="[]"))
        batch.add_column(sa.Column("memory_max", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("cpu_quota", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("pids_max", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("limit_nofile", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("credentials", sa.Text(), nullable=False, server_default="{}"))
    with op.batch_alter_table("generations", recreate="never") as batch:
        batch.add_column(sa.Column("run_user", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("generations", recreate="never") as batch:
        batch.drop_column("run_user")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        for name in reversed(HOST_COLUMNS):
            batch.drop_column(name)
