"""Who names a host in its start order, read without the fleet's hosts (issue 28 item 1):
a partial index of the hosts that have an order (`start_after` not `[]`), so a stop or a
wake that asks which hosts name one reads those few, not every host of every box. The
1,000-box simulation (bench/fleet.py --phantoms 1000) showed that read as the one
statement of an intent that scanned the fleet: 20,200 rows twice per intent.
Only an index: nothing is rebuilt, every row stays.

Revision ID: 0030
Revises: 0029
"""
import sqlalchemy as sa
from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

ORDERED = sa.text("start_after <> '[]'")  # a literal: the planner proves a query's WHERE implies it


def upgrade() -> None:
    op.create_index("ix_hosts_ordered", "hosts", ["name"], sqlite_where=ORDERED,
                    postgresql_where=ORDERED)


def downgrade() -> None:
    op.drop_index("ix_hosts_ordered", "hosts")
