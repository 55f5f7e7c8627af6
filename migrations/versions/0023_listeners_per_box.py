"""A listener address is unique per box among hosts whose placements can meet (issue 28
item 5), and what a box does with a host while the store cannot be reached (item 4).

Listeners: an address is no longer unique store-wide: host a on box1 and host b on box2 may each listen on
tcp:127.0.0.1:8080. The rule is checked in the transaction that writes the address, under a
lock (workflows/generations/listeners.py: check_free), since no index can hold it.

On SQLite dropping the unique constraint rebuilds `listeners` (no table references it, so
the copy-drop-rename deletes nothing); its definition is given here rather than reflected,
so the state CHECK and the foreign key are kept as they are.

`hosts.on_store_loss` ("fence", today's behaviour and the default for every host written
before; or "keep") is added by ALTER TABLE ADD COLUMN (no rebuild of `hosts`: on SQLite that
would cascade-delete every row that references a host). PostgreSQL gets a CHECK; SQLite the
same rule as two triggers, as 0006 does for the durations.

Revision ID: 0023
Revises: 0022
"""
import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
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


CHECK = "ck_hosts_on_store_loss"
RULE = "{p}on_store_loss IN ('fence', 'keep')"


def upgrade() -> None:
    with op.batch_alter_table("listeners", copy_from=_listeners(True)) as batch:
        batch.drop_constraint("uq_listeners_address", type_="unique")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("on_store_loss", sa.String(length=8), nullable=False,
                                   server_default="fence"))
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(CHECK, "hosts", RULE.format(p=""))
        return
    raise_ = f"SELECT RAISE(ABORT, 'CHECK constraint failed: {CHECK}');"
    op.execute(f"CREATE TRIGGER {CHECK}_insert BEFORE INSERT ON hosts "
               f"WHEN NOT ({RULE.format(p='NEW.')}) BEGIN {raise_} END")
    op.execute(f"CREATE TRIGGER {CHECK}_update BEFORE UPDATE OF on_store_loss ON hosts "
               f"WHEN NOT ({RULE.format(p='NEW.')}) BEGIN {raise_} END")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(CHECK, "hosts", type_="check")
    else:
        op.execute(f"DROP TRIGGER IF EXISTS {CHECK}_insert")
        op.execute(f"DROP TRIGGER IF EXISTS {CHECK}_update")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("on_store_loss")
    # Refused by the database while two hosts share an address (on different boxes): give
    # one of them another address first.
    with op.batch_alter_table("listeners", copy_from=_listeners(False)) as batch:
        batch.create_unique_constraint("uq_listeners_address", ["address"])
