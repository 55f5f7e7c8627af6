"""Instances (issue 27 item 1): a host on held listeners runs `instances` processes of the
same build, each a generation in its own slot (0..instances-1), and a wake names the slot
it starts, and a stop the one slot it ends (`vigil scale` down; NULL: every slot).

The store still holds the rule it held for one: "at most one current generation per host"
becomes "at most one per host and slot", the same partial unique index over (host, slot).
Columns are added by ALTER TABLE ADD COLUMN with a server default (no rebuild: on SQLite
that would cascade-delete every row that references a host or a generation); every row
written before is slot 0 of a host of one instance.

Revision ID: 0024
Revises: 0023
"""
import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

_CURRENT = sa.text("state = 'current'")


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("instances", sa.Integer(), nullable=False, server_default="1"))
    with op.batch_alter_table("wakes", recreate="never") as batch:
        batch.add_column(sa.Column("slot", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("stops", recreate="never") as batch:
        batch.add_column(sa.Column("slot", sa.Integer(), nullable=True))
    with op.batch_alter_table("generations", recreate="never") as batch:
        batch.add_column(sa.Column("slot", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_index("ux_generations_one_current", sqlite_where=_CURRENT,
                         postgresql_where=_CURRENT)
        batch.create_index("ux_generations_one_current", ["host", "slot"], unique=True,
                           sqlite_where=_CURRENT, postgresql_where=_CURRENT)


def downgrade() -> None:
    # Refused while a host runs more than one instance: the old index cannot hold them.
    with op.batch_alter_table("generations", recreate="never") as batch:
        batch.drop_index("ux_generations_one_current", sqlite_where=_CURRENT,
                         postgresql_where=_CURRENT)
        batch.create_index("ux_generations_one_current", ["host"], unique=True,
                           sqlite_where=_CURRENT, postgresql_where=_CURRENT)
        batch.drop_column("slot")
    with op.batch_alter_table("stops", recreate="never") as batch:
        batch.drop_column("slot")
    with op.batch_alter_table("wakes", recreate="never") as batch:
        batch.drop_column("slot")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("instances")
