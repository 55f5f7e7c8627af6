"""A listener address is unique per box among hosts whose placements can meet (issue 28
item 5), no longer store-wide: host a on box1 and host b on box2 may each listen on
tcp:127.0.0.1:8080. The rule is checked in the transaction that writes the address, under a
lock (workflows/generations/listeners.py: check_free), since no index can hold it.

On SQLite dropping the unique constraint rebuilds `listeners` (no table references it, so
the copy-drop-rename deletes nothing); its definition is given here rather than reflected,
so the state CHECK and the foreign key are kept as they are.

Revision ID: 0023
Revises: 0021
"""
import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0021"
branch_labels = None
depends_on = None

STATES = ("new", "opening", "held", "lost")
# models/tables.py's naming convention: the state CHECK is named ck_listeners_listener_state.
NAMING = {"ck": "ck_%(table_name)s_%(constraint_name)s"}


def _listeners(unique: bool) -> sa.Table:
    return sa.Table(
        "listeners", sa.MetaData(naming_convention=NAMING),
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
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], name="fk_listeners_host_hosts",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("host", "position", name="pk_listeners"),
        *([sa.UniqueConstraint("address", name="uq_listeners_address")] if unique else []),
    )


def upgrade() -> None:
    with op.batch_alter_table("listeners", copy_from=_listeners(True)) as batch:
        batch.drop_constraint("uq_listeners_address", type_="unique")


def downgrade() -> None:
    # Refused by the database while two hosts share an address (on different boxes): give
    # one of them another address first.
    with op.batch_alter_table("listeners", copy_from=_listeners(False)) as batch:
        batch.create_unique_constraint("uq_listeners_address", ["address"])
