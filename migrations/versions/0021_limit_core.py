"""The core-dump size limit of a host's generations (issue 21 item 2: `--limit-core`,
RLIMIT_CORE, soft and hard, in bytes; 0 writes no core file), beside 0018's limit_nofile.

Added by ALTER TABLE ADD COLUMN, nullable (no rebuild: on SQLite that would cascade-delete
every row that references a host): a host written before keeps the agent's own limit.

Revision ID: 0021
Revises: 0020
"""
import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("limit_core", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("limit_core")
