"""One store of restart streaks (issue 38 item 4): slot 0's streak, every worker's and every
host of one instance's, joins slots 1.. in `slot_streaks` (0026), and `hosts.restart_streak`
is dropped. A streak of 0 is no row. The column is dropped by ALTER TABLE (no rebuild: on
SQLite that would cascade-delete every row that references a host); a downgrade adds it
back and returns slot 0's rows to it.

Revision ID: 0033
Revises: 0032
"""
import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("INSERT INTO slot_streaks (host, slot, streak) "
               "SELECT name, 0, restart_streak FROM hosts WHERE restart_streak <> 0")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("restart_streak")


def downgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("restart_streak", sa.Integer(), server_default="0",
                                   nullable=False))
    op.execute("UPDATE hosts SET restart_streak = (SELECT streak FROM slot_streaks "
               "WHERE slot_streaks.host = hosts.name AND slot = 0) "
               "WHERE name IN (SELECT host FROM slot_streaks WHERE slot = 0)")
    op.execute("DELETE FROM slot_streaks WHERE slot = 0")
