"""Indexes for the lease reads every agent runs on a clock (issue 28 item 1), so each one
reads this box's leases or the expired ones, never every lease of the fleet:

- (holder, expires_at): a box's own leases, by what is due for renewal: the sweep's renewal
  (holder = me and expires_at < half), the renewal thread's (holder = me), and every join
  that starts from "the leases this box holds" (fencing, liveness, probes, workers);
- expires_at: the expired leases, which the sweep's orphan read looks for every second and
  which are none while every box is alive.

Indexes only: no table is rebuilt, every row stays.

Revision ID: 0022
Revises: 0021
"""
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

INDEXES = {"ix_leases_holder_expires_at": ["holder", "expires_at"],
           "ix_leases_expires_at": ["expires_at"]}


def upgrade() -> None:
    for name, columns in INDEXES.items():
        op.create_index(name, "leases", columns)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, "leases")
