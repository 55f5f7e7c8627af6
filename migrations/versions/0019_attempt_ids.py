"""Attempt ids are never reused (issue 20 item 16): on SQLite an INTEGER PRIMARY KEY takes
max(id) + 1, so after `host rm` deleted the newest attempts the next host's attempts took
their numbers again (events of both said `attempt=#38`). AUTOINCREMENT keeps the largest id
ever given in sqlite_sequence. SQLite can add it only by rebuilding `attempts` (with the
members rows, the only rows with a foreign key to attempts, set aside meanwhile, and the
view dropped and created again, as in 0014); the rows copied carry their ids, so the
sequence starts at the largest one kept. PostgreSQL's sequence never goes back: nothing to
do there. Downgrade rebuilds the table without AUTOINCREMENT.

Revision ID: 0019
Revises: 0017
"""
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

# A frozen copy of the view at this revision (unchanged since 0014).
VIEW_0019 = """CREATE VIEW pending_obligations AS
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


def _rebuild(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute("CREATE TEMPORARY TABLE members_0019 AS SELECT * FROM members")
    op.execute("DELETE FROM members")
    with op.batch_alter_table("attempts", recreate="always",
                              table_kwargs={"sqlite_autoincrement": autoincrement}):
        pass
    op.execute("INSERT INTO members SELECT * FROM members_0019")
    op.execute("DROP TABLE members_0019")
    op.execute(VIEW_0019)


def upgrade() -> None:
    _rebuild(True)


def downgrade() -> None:
    _rebuild(False)
