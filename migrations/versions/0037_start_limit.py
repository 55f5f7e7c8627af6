"""A crash loop that gives up: the start limit and the failed host (issue 39, item 5).

`hosts.start_limit` ("N/SECONDS" as `--start-limit` and `start_limit = "5/60"` in a hosts file
write it; NULL: no limit, today's behaviour) is added by ALTER TABLE ADD COLUMN (no rebuild of
`hosts`: on SQLite that would cascade-delete every row that references a host).
PostgreSQL gets a CHECK; SQLite the same rule as two triggers, as 0023 does. A slot's restart
streak row (`slot_streaks`, models/streaks.py) gains the times of its recent quick exits
(`quick_exits`, a JSON list of epoch seconds) and `failed_at`: set when the start limit made
the slot give up, cleared by `vigil retry`, a wake or a deploy.

Revision ID: 0037
Revises: 0036
"""
import sqlalchemy as sa
from alembic import op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None

CHECK = "ck_hosts_start_limit"
RULE = "{p}start_limit IS NULL OR {p}start_limit LIKE '_%/_%'"


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("start_limit", sa.String(length=24), nullable=True))
    with op.batch_alter_table("slot_streaks", recreate="never") as batch:
        batch.add_column(sa.Column("quick_exits", sa.Text(), nullable=False,
                                   server_default="[]"))
        batch.add_column(sa.Column("failed_at", sa.DateTime(), nullable=True))
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(CHECK, "hosts", RULE.format(p=""))
        return
    raise_ = f"SELECT RAISE(ABORT, 'CHECK constraint failed: {CHECK}');"
    op.execute(f"CREATE TRIGGER {CHECK}_insert BEFORE INSERT ON hosts "
               f"WHEN NOT ({RULE.format(p='NEW.')}) BEGIN {raise_} END")
    op.execute(f"CREATE TRIGGER {CHECK}_update BEFORE UPDATE OF start_limit ON hosts "
               f"WHEN NOT ({RULE.format(p='NEW.')}) BEGIN {raise_} END")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(CHECK, "hosts", type_="check")
    else:
        op.execute(f"DROP TRIGGER IF EXISTS {CHECK}_insert")
        op.execute(f"DROP TRIGGER IF EXISTS {CHECK}_update")
    with op.batch_alter_table("slot_streaks", recreate="never") as batch:
        batch.drop_column("failed_at")
        batch.drop_column("quick_exits")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("start_limit")
