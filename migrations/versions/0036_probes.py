"""Probes of the app's own: http:PATH, tcp, exec:CMD (issue 39, item 4).

`hosts.health` says what the ongoing health probe of a host asks (NULL: `GET /` below 500,
as before; "http:PATH", "tcp", "exec:CMD"); its interval and threshold stay
`health_interval` and `unhealthy_after`. The readiness kinds are new values of the
existing `hosts.ready` (Text, checked by the CLI as `ready` is), so it needs no change.

Added by ALTER TABLE ADD COLUMN, nullable (no rebuild: on SQLite that would cascade-delete
every row that references a host); rows written before probe as they did.

Revision ID: 0036
Revises: 0035
"""
import sqlalchemy as sa
from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("health", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("health")
