"""Rings a box can poll instead of LISTEN (issue 28 item 1, at 1,000 boxes): every NOTIFY
migration 0031's trigger sends is also written as a row of `rings` (its channel, the
store's time), and an agent run with `--listen off` reads its own box's and the shared
channel's new rows in its one-second sweep. PostgreSQL wakes every listening session of the
database at each commit that notifies (bench/listeners.py: 20 ms of server CPU a commit with
1,000 sessions listening), so a large fleet may run without LISTEN and notice intents within
a sweep instead.

Rows, not a counter per box: a counter row would be locked by every transaction that writes
an intent for the box until it commits (the agent's drive threads and the CLI would wait on
each other, and two transactions ringing two boxes in opposite orders would deadlock); an
insert locks nothing another writer needs. A ring is found by (channel, at); the store-wide
prune deletes rings older than an hour.

PostgreSQL only writes them: SQLite's one agent polls its file (`PRAGMA data_version`).

Revision ID: 0032
Revises: 0030
"""
import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0030"
branch_labels = None
depends_on = None

FUNCTION = "vigil_ring_boxes"
RING = "INSERT INTO rings (channel, at) VALUES ({ch}, timezone('utc', clock_timestamp()))"

# 0031's body, each pg_notify followed by its ring row (the same channel names).
BODY = r"""
DECLARE
    placed text;
    b text;
    ch text;
BEGIN
    IF TG_ARGV[0] = 'shared' THEN
        PERFORM pg_notify('vigil', '');
        """ + RING.format(ch="'vigil'") + r""";
        RETURN NULL;
    END IF;
    SELECT box INTO placed FROM hosts WHERE name = NEW.host;
    IF coalesce(placed, '') = '' THEN
        PERFORM pg_notify('vigil', '');
        """ + RING.format(ch="'vigil'") + r""";
        RETURN NULL;
    END IF;
    FOREACH b IN ARRAY string_to_array(placed, ',') LOOP
        ch := 'vigil_box_' || left(encode(sha256(convert_to(b, 'UTF8')), 'hex'), 32);
        PERFORM pg_notify(ch, '');
        """ + RING.format(ch="ch") + r""";
    END LOOP;
    RETURN NULL;
END
"""

OLD_BODY = r"""
DECLARE
    placed text;
    b text;
BEGIN
    IF TG_ARGV[0] = 'shared' THEN
        PERFORM pg_notify('vigil', '');
        RETURN NULL;
    END IF;
    SELECT box INTO placed FROM hosts WHERE name = NEW.host;
    IF coalesce(placed, '') = '' THEN
        PERFORM pg_notify('vigil', '');
        RETURN NULL;
    END IF;
    FOREACH b IN ARRAY string_to_array(placed, ',') LOOP
        PERFORM pg_notify('vigil_box_' || left(encode(sha256(convert_to(b, 'UTF8')), 'hex'), 32), '');
    END LOOP;
    RETURN NULL;
END
"""


def upgrade() -> None:
    op.create_table(
        "rings",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("channel", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_rings"),
    )
    op.create_index("ix_rings_channel_at", "rings", ["channel", "at"])
    op.create_index("ix_rings_at", "rings", ["at"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql "
                   f"AS $body${BODY}$body$")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql "
                   f"AS $body${OLD_BODY}$body$")
    op.drop_index("ix_rings_at", "rings")
    op.drop_index("ix_rings_channel_at", "rings")
    op.drop_table("rings")
