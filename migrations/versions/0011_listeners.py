"""Listening sockets vigil holds for a host (socket activation) and how a generation says
it is ready.

`listeners` is a new table (no rebuild of `hosts`: on SQLite that would cascade-delete
every row that references a host); `hosts.ready` is added by ALTER TABLE ADD COLUMN.

Revision ID: 0011
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0009"
branch_labels = None
depends_on = None

STATES = ("new", "opening", "held", "lost")


def upgrade() -> None:
    op.create_table(
        "listeners",
        sa.Column("host", sa.String(length=63), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column("state", sa.Enum(*STATES, name="listener_state", native_enum=False,
                                   create_constraint=True, length=16), nullable=False),
        sa.Column("agent_id", sa.String(length=64), nullable=True),
        sa.Column("inode", sa.BigInteger(), nullable=True),
        sa.Column("boot_id", sa.String(length=36), nullable=True),
        sa.Column("opened_at", sa.DateTime(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], name=op.f("fk_listeners_host_hosts"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("host", "position", name=op.f("pk_listeners")),
        sa.UniqueConstraint("address", name=op.f("uq_listeners_address")),
    )
    with op.batch_alter_table("hosts", recreate="never") as batch:  # ALTER TABLE ADD COLUMN
        batch.add_column(sa.Column("ready", sa.Text(), nullable=True))


def downgrade() -> None:
    # Never recreate `hosts` on SQLite (see 0004): native DROP COLUMN keeps the rows.
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("ready")
    op.drop_table("listeners")
