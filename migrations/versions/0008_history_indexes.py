"""Indexes that keep a round's cost flat as history grows, and let retention find what it
may prune (workflows/engine/history.py):

- open rows by due time: wakes and stops (state, next_attempt_at), attempts (outcome,
  next_attempt_at). A round's read of the earliest due row of each host walked every past
  row through the next_attempt_at index (a done row's due time is in the past too);
- live generations by state (state, host), read by the exit watcher, the backstop and the
  sanity check of every round;
- a host's rows newest first (host, id) for generations, wakes, stops and attempts, in place
  of the index on host alone (which it serves as well): retention keeps each host's newest N;
- every column that names a generation or an attempt (wakes, stops: generation_id;
  attempts: successor_id, retiring_id; members: attempt_id): deleting one (retention) checks
  them, as the foreign keys do, which without an index is a scan per row deleted.

Indexes only: no table is rebuilt, every row stays.

Revision ID: 0008
Revises: 0006
"""
from alembic import op

revision = "0008"
down_revision = "0006"
branch_labels = None
depends_on = None

OPEN_BY_DUE = {"wakes": "state", "stops": "state", "attempts": "outcome"}
NEWEST_FIRST = ("generations", "wakes", "stops", "attempts")
REFERENCES = {"wakes": "generation_id", "stops": "generation_id", "attempts": "successor_id",
              "members": "attempt_id"}


def upgrade() -> None:
    for table, column in OPEN_BY_DUE.items():
        op.create_index(f"ix_{table}_{column}_next_attempt_at", table, [column, "next_attempt_at"])
    op.create_index("ix_generations_state_host", "generations", ["state", "host"])
    for table in NEWEST_FIRST:
        op.create_index(f"ix_{table}_host_id", table, ["host", "id"])
        op.drop_index(f"ix_{table}_host", table)
    for table, column in [*REFERENCES.items(), ("attempts", "retiring_id")]:
        op.create_index(f"ix_{table}_{column}", table, [column])


def downgrade() -> None:
    for table, column in [*REFERENCES.items(), ("attempts", "retiring_id")]:
        op.drop_index(f"ix_{table}_{column}", table)
    for table in NEWEST_FIRST:
        op.create_index(f"ix_{table}_host", table, ["host"])
        op.drop_index(f"ix_{table}_host_id", table)
    op.drop_index("ix_generations_state_host", "generations")
    for table, column in OPEN_BY_DUE.items():
        op.drop_index(f"ix_{table}_{column}_next_attempt_at", table)
