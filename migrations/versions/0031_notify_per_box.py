"""NOTIFY per box (issue 28 item 1): each new intent row rings, in its own transaction, the
channel of each box its host is placed on, or the shared channel `vigil` when the host is
placed nowhere (and for a rollout, which belongs to no host). Before, every intent woke every
agent of the fleet.

A trigger per intent table rather than a call in each writer: every writer rings (the CLI,
an agent admitting a rollout's wave for hosts other boxes hold, plain SQL), and the NOTIFY
commits with the row or not at all. Only INSERT rings: the intents the CLI and the agents
write are new rows; an agent moving its own rows along wakes nobody.

A box's channel is `vigil_box_` + the first 32 hex digits of the SHA-256 of its name
(runners/base/wakeup.py box_channel): a plain identifier for any box name, within 63 bytes.

PostgreSQL only: SQLite holds one box, rung by the CLI's doorbell and its data_version poll.

Revision ID: 0031
Revises: 0026
"""
from alembic import op

revision = "0031"
down_revision = "0026"
branch_labels = None
depends_on = None

FUNCTION = "vigil_ring_boxes"
HOST_TABLES = ("wakes", "stops", "releases", "restores", "attempts")
SHARED_TABLES = ("rollouts",)

BODY = r"""
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
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"CREATE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $body${BODY}$body$")
    for table in HOST_TABLES + SHARED_TABLES:
        arg = "shared" if table in SHARED_TABLES else "host"
        op.execute(f"CREATE TRIGGER {table}_ring AFTER INSERT ON {table} "
                   f"FOR EACH ROW EXECUTE FUNCTION {FUNCTION}('{arg}')")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in HOST_TABLES + SHARED_TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS {table}_ring ON {table}")
    op.execute(f"DROP FUNCTION IF EXISTS {FUNCTION}()")
