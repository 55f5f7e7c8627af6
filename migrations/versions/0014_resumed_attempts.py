"""An overlap attempt interrupted before its switch (the agent restarted) is written again
as a new attempt: the attempt cause `resumed`, and `attempts.resumed_from`, the attempt it
replaces (indexed: a --wait and `vigil status` follow the chain forward).

As in 0009, the new cause means a new CHECK constraint: PostgreSQL swaps it in place;
SQLite rebuilds `attempts` with the members rows (the only rows with a foreign key to
attempts) set aside in a temporary table for the rebuild, and the new column rides in the
same rebuild. `resumed_from` has no foreign key (a self-reference would fail the rebuild's
own drop). Downgrade turns `resumed` attempts into `release` ones before the old CHECK
comes back.

Revision ID: 0014
Revises: 0013
"""
import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

OLD_CAUSES = ("release", "retry", "restart", "config", "rollout")
NEW_CAUSES = (*OLD_CAUSES, "resumed")
CHECK = "ck_attempts_cause"
INDEX = "ix_attempts_resumed_from"

# A frozen copy of the view at this revision (the same as 0009's): the rebuild of attempts
# on SQLite needs it dropped and created again.
VIEW_0014 = """CREATE VIEW pending_obligations AS
SELECT 'wake' AS kind, host, generation_id AS generation, since, attempts,
       next_attempt_at, last_error FROM wakes WHERE state IN ('queued', 'leased', 'spawning', 'checking', 'reaping')
UNION ALL
SELECT 'unproven_wake', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM wakes WHERE state = 'unproven'
UNION ALL
SELECT 'stop', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM stops WHERE state IN ('queued', 'signalled')
UNION ALL
SELECT 'release', host, CAST(NULL AS INTEGER), since, attempts, next_attempt_at, last_error
  FROM releases
UNION ALL
SELECT 'restore', host, CAST(NULL AS INTEGER), since, attempts, next_attempt_at, last_error
  FROM restores
UNION ALL
SELECT 'attempt', host, successor_id, since, attempts, next_attempt_at, last_error
  FROM attempts WHERE outcome IS NULL
UNION ALL
SELECT CASE WHEN unproven THEN 'unproven_member' ELSE 'member' END, host, generation_id,
       since, attempts, next_attempt_at, last_error
  FROM members
UNION ALL
SELECT 'rollout', 'rollout #' || CAST(id AS VARCHAR(20)), CAST(NULL AS INTEGER), since, attempts, next_attempt_at,
       last_error
  FROM rollouts WHERE state IN ('running', 'paused', 'halted', 'reverting', 'aborting')
"""


def _causes(values: tuple[str, ...]) -> str:
    return "cause IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def _rebuild(values: tuple[str, ...], *, add: bool) -> None:
    """The cause CHECK becomes `values`; the column is added (add) or dropped."""
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f(CHECK), "attempts", type_="check")
        op.create_check_constraint(op.f(CHECK), "attempts", _causes(values))
        if add:
            op.add_column("attempts", sa.Column("resumed_from", sa.Integer(), nullable=True))
            op.create_index(op.f(INDEX), "attempts", ["resumed_from"])
        else:
            op.drop_index(op.f(INDEX), "attempts")
            op.drop_column("attempts", "resumed_from")
        return
    op.execute("CREATE TEMPORARY TABLE members_0014 AS SELECT * FROM members")
    op.execute("DELETE FROM members")
    with op.batch_alter_table("attempts", recreate="always") as batch:
        batch.drop_constraint(op.f(CHECK), type_="check")
        batch.create_check_constraint(op.f(CHECK), _causes(values))
        if add:
            batch.add_column(sa.Column("resumed_from", sa.Integer(), nullable=True))
            batch.create_index(op.f(INDEX), ["resumed_from"])
        else:
            batch.drop_index(op.f(INDEX))
            batch.drop_column("resumed_from")
    op.execute("INSERT INTO members SELECT * FROM members_0014")
    op.execute("DROP TABLE members_0014")


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    _rebuild(NEW_CAUSES, add=True)
    op.execute(VIEW_0014)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute("UPDATE attempts SET cause = 'release' WHERE cause = 'resumed'")
    _rebuild(OLD_CAUSES, add=False)
    op.execute(VIEW_0014)
