"""Rollouts: one build to many hosts in waves (tables rollouts, rollout_targets), the
failure book (held_builds), the attempt cause `rollout`, and open rollouts in the
pending_obligations view.

attempts.cause gets the value `rollout`, which means a new CHECK constraint. PostgreSQL
swaps it in place. SQLite can only rebuild the table (copy, drop, rename), and with foreign
keys on the drop's implicit DELETE would fail on the members rows that point at attempts
(a deferred check does not help: the copy was inserted under another name, so the violation
count never goes back to zero). So on SQLite the members rows are set aside in a temporary
table for the rebuild and put back in the same transaction. Nothing cascades from attempts,
so no other row is touched; `hosts` is not rebuilt.

The new tables carry no foreign keys to attempts or builds (only to rollouts and hosts),
so a later rebuild of attempts does not meet them, and builds rows are never deleted (gc
only marks them). Downgrade turns `rollout` attempts into `release` ones before the old
CHECK comes back.

Revision ID: 0009
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

OLD_CAUSES = ("release", "retry", "restart", "config")
NEW_CAUSES = (*OLD_CAUSES, "rollout")

# Frozen copies of the view before and after this revision.
_VIEW_HEAD = """CREATE VIEW pending_obligations AS
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
"""
VIEW_0006 = _VIEW_HEAD
VIEW_0009 = _VIEW_HEAD + """UNION ALL
SELECT 'rollout', 'rollout #' || CAST(id AS VARCHAR(20)), CAST(NULL AS INTEGER), since, attempts, next_attempt_at,
       last_error
  FROM rollouts WHERE state IN ('running', 'paused', 'halted', 'reverting', 'aborting')
"""


def _causes(values: tuple[str, ...]) -> str:
    return "cause IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def _set_causes(values: tuple[str, ...]) -> None:
    name = "ck_attempts_cause"
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f(name), "attempts", type_="check")
        op.create_check_constraint(op.f(name), "attempts", _causes(values))
        return
    op.execute("CREATE TEMPORARY TABLE members_0009 AS SELECT * FROM members")
    op.execute("DELETE FROM members")
    with op.batch_alter_table("attempts", recreate="always") as batch:
        batch.drop_constraint(op.f(name), type_="check")
        batch.create_check_constraint(op.f(name), _causes(values))
    op.execute("INSERT INTO members SELECT * FROM members_0009")
    op.execute("DROP TABLE members_0009")


def _retry_columns() -> list[sa.Column]:  # type: ignore[type-arg]
    return [
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("since", sa.DateTime(), nullable=False),
    ]


def _enum(*values: str, name: str) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=True, length=16)


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    _set_causes(NEW_CAUSES)
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("build_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("mode", _enum("overlap", "hold", name="mode"), nullable=False),
        sa.Column("canary", sa.Boolean(), nullable=False),
        sa.Column("waves", sa.Text(), nullable=False),
        sa.Column("wave_count", sa.Integer(), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=False),
        sa.Column("settled", sa.Integer(), nullable=False),
        sa.Column("pause", sa.Float(), nullable=True),
        sa.Column("wave_due_at", sa.DateTime(), nullable=True),
        sa.Column("max_failures", sa.Integer(), nullable=False),
        sa.Column("auto_revert", sa.Boolean(), nullable=False),
        sa.Column("after_attempt", sa.Integer(), nullable=False),
        sa.Column("after_stop", sa.Integer(), nullable=False),
        sa.Column("state", _enum("running", "paused", "halted", "reverting", "aborting", "ended",
                                 name="rollout_state"), nullable=False),
        sa.Column("outcome", _enum("done", "halted", "reverted", "aborted",
                                   name="rollout_outcome"), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        *_retry_columns(),
        sa.CheckConstraint("pause IS NULL OR (pause > 0 AND pause <= 86400)",
                           name=op.f("ck_rollouts_pause")),
        sa.CheckConstraint("max_failures >= 0", name=op.f("ck_rollouts_max_failures")),
        sa.ForeignKeyConstraint(["build_id"], ["builds.id"],
                                name=op.f("fk_rollouts_build_id_builds")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollouts")),
    )
    with op.batch_alter_table("rollouts") as batch:
        batch.create_index(batch.f("ix_rollouts_next_attempt_at"), ["next_attempt_at"],
                           unique=False)
    op.create_table(
        "rollout_targets",
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=63), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=False),
        sa.Column("state", _enum("pending", "deploying", "done", "failed", "abandoned", "skipped",
                                 "reverting", "reverted", "revert_failed", name="target_state"),
                  nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=True),
        sa.Column("revert_attempt_id", sa.Integer(), nullable=True),
        sa.Column("from_build_id", sa.Integer(), nullable=True),
        sa.Column("tries", sa.Integer(), nullable=False),
        sa.Column("spent", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], name=op.f("fk_rollout_targets_host_hosts"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"],
                                name=op.f("fk_rollout_targets_rollout_id_rollouts"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("rollout_id", "host", name=op.f("pk_rollout_targets")),
    )
    with op.batch_alter_table("rollout_targets") as batch:
        batch.create_index(batch.f("ix_rollout_targets_host"), ["host"], unique=False)
    op.create_table(
        "held_builds",
        sa.Column("host", sa.String(length=63), nullable=False),
        sa.Column("build_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("since", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], name=op.f("fk_held_builds_host_hosts"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("host", "build_id", name=op.f("pk_held_builds")),
    )
    op.execute(VIEW_0009)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.drop_table("held_builds")
    with op.batch_alter_table("rollout_targets") as batch:
        batch.drop_index(batch.f("ix_rollout_targets_host"))
    op.drop_table("rollout_targets")
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_index(batch.f("ix_rollouts_next_attempt_at"))
    op.drop_table("rollouts")
    op.execute("UPDATE attempts SET cause = 'release' WHERE cause = 'rollout'")
    _set_causes(OLD_CAUSES)
    op.execute(VIEW_0006)
