"""Per-host socket access: the group and mode a generation's socket is given before the
switch makes it canonical (NULL: the agent-wide setting, else owner-only).

Revision ID: 0004
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:  # ALTER TABLE ADD COLUMN
        batch.add_column(sa.Column("socket_group", sa.String(length=32), nullable=True))
        batch.add_column(sa.Column("socket_mode", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Never recreate `hosts` on SQLite: the copy-drop-rename would run with foreign keys on
    # and its DROP TABLE would cascade-delete every row that references a host. Native
    # ALTER TABLE ... DROP COLUMN (SQLite 3.35+) keeps them.
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("socket_mode")
        batch.drop_column("socket_group")
