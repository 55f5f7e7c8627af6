"""A host's own stop signal and stop command (issue 39, item 1).

`hosts.stop_signal` (a signal name without SIG; "TERM", today's behaviour and the default
for every host written before) and `hosts.stop_command` (NULL: send the signal) are added by
ALTER TABLE ADD COLUMN, as 0023 adds on_store_loss (no rebuild of `hosts`: on SQLite that
would cascade-delete every row that references a host). No CHECK: the names a box knows
are the code's to check (workflows/generations/stopway.py), and a name it does not know is
sent as TERM.

Revision ID: 0035
Revises: 0034
"""
import sqlalchemy as sa
from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("stop_signal", sa.String(length=16), nullable=False,
                                   server_default="TERM"))
        batch.add_column(sa.Column("stop_command", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("stop_command")
        batch.drop_column("stop_signal")
