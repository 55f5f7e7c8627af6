"""One agent does the store-wide chores (issue 28 item 1): a `chores` row held like a
lease (holder, expiry by the store's clock, an epoch counting the holders). Its holder alone
runs the history prune and attaches the scheduled restarts' job store; another agent takes
it once it expires. Its one row, `store`, is written by the first agent to take the chores.
A new table only: nothing is rebuilt.

Revision ID: 0028
Revises: 0025
"""
import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0025"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "chores",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=64), nullable=True),
        sa.Column("epoch", sa.Integer(), server_default="0", nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_chores"),
    )


def downgrade() -> None:
    op.drop_table("chores")
