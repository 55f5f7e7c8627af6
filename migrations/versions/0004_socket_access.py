"""Per-host socket access: the group and mode a generation's socket is given before the
switch makes it canonical (NULL: the agent-wide setting, else owner-only).

Revision ID: 0004
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.add_column(sa.Column("socket_group", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("socket_mode", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts") as batch:
        batch.drop_column("socket_mode")
        batch.drop_column("socket_group")
