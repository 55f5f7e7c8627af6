"""A restart streak per instance (issue 27 item 1): each slot of a host of instances backs
off by its own quick exits in a row, not its siblings'. Slot 0 keeps the host's own
`restart_streak` (a host of one instance is unchanged); slots 1.. have a row here once they
exit. A new table only: nothing is rebuilt.

Revision ID: 0026
Revises: 0028
"""
import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "slot_streaks",
        sa.Column("host", sa.String(length=63), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("streak", sa.Integer(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], name=op.f("fk_slot_streaks_host_hosts"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("host", "slot", name=op.f("pk_slot_streaks")),
    )


def downgrade() -> None:
    op.drop_table("slot_streaks")
