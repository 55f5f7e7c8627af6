"""Start order between hosts (issue 21 item 6): `hosts.start_after`, the names a wake of
the host waits for (awake and ready), as a JSON list like 0018's env_files, and
`wakes.waiting_on`, the hosts a queued wake is held back by ("a, b"), written in the step
that decided it.

A column, not a table of pairs: the order is one more setting of a host, read and written
with it by `host add|set|show` and `vigil apply` (whose diff compares columns), and an
operator reads it beside the host (`SELECT name, start_after FROM hosts`). Who names a
host is a scan of the hosts that name any, which are few.

Both are added by ALTER TABLE ADD COLUMN with a default (no rebuild: on SQLite that would
cascade-delete every row that references a host), so rows written before keep working: a
host without an order starts as before, and pending_obligations, unchanged, shows a
waiting wake as the queued wake it is, its last_error saying what it waits on.

Revision ID: 0020
Revises: 0019
"""
import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("start_after", sa.Text(), nullable=False, server_default="[]"))
    with op.batch_alter_table("wakes", recreate="never") as batch:
        batch.add_column(sa.Column("waiting_on", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("wakes", recreate="never") as batch:
        batch.drop_column("waiting_on")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("start_after")
