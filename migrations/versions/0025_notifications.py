"""Durable notifications (issue 23 item 4): notifiers (`vigil notify add`) and their --on
words, a delivery row per event owed to a notifier (written in the event's own transaction)
and the log of every try at one; undelivered rows in pending_obligations.

Only new tables: nothing written before is rebuilt. The view is dropped and created again
with its new branch (as 0009 and 0014 did); downgrade puts 0019's back.

Revision ID: 0025
Revises: 0024
"""
import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

# Frozen copies of the view before and after this revision.
VIEW_0021 = """CREATE VIEW pending_obligations AS
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
VIEW_0025 = VIEW_0021 + """UNION ALL
SELECT 'notification', 'notify ' || notifier, generation_id, since, attempts, next_attempt_at,
       last_error
  FROM deliveries WHERE delivered_at IS NULL
"""
OUTCOMES = ("delivered", "failed", "timeout", "interrupted")


def _retry_columns() -> list[sa.Column]:  # type: ignore[type-arg]
    return [sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
            sa.Column("next_attempt_at", sa.DateTime(), nullable=False),
            sa.Column("last_error", sa.Text(), nullable=True),
            sa.Column("since", sa.DateTime(), nullable=False)]


def upgrade() -> None:
    op.create_table(
        "notifiers",
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("exec", sa.Text(), nullable=True),
        sa.Column("webhook", sa.Text(), nullable=True),
        sa.Column("timeout", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("(exec IS NULL) <> (webhook IS NULL)", name=op.f("ck_notifiers_one_target")),
        sa.CheckConstraint("timeout > 0 AND timeout <= 20", name=op.f("ck_notifiers_timeout")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_notifiers")))
    op.create_table(
        "notify_on",
        sa.Column("notifier", sa.String(63), nullable=False),
        sa.Column("word", sa.String(16), nullable=False),
        sa.ForeignKeyConstraint(["notifier"], ["notifiers.name"], ondelete="CASCADE",
                                name=op.f("fk_notify_on_notifier_notifiers")),
        sa.PrimaryKeyConstraint("notifier", "word", name=op.f("pk_notify_on")))
    op.create_index(op.f("ix_notify_on_word"), "notify_on", ["word"])
    op.create_table(
        "deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("notifier", sa.String(63), nullable=False),
        sa.Column("event_id", sa.Integer(), nullable=False),
        sa.Column("word", sa.String(16), nullable=False),
        sa.Column("host", sa.String(63), nullable=True),
        sa.Column("generation_id", sa.Integer(), nullable=True),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("delivered_at", sa.DateTime(), nullable=True),
        *_retry_columns(),
        sa.ForeignKeyConstraint(["notifier"], ["notifiers.name"], ondelete="CASCADE",
                                name=op.f("fk_deliveries_notifier_notifiers")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deliveries")),
        sqlite_autoincrement=True)
    op.create_index(op.f("ix_deliveries_next_attempt_at"), "deliveries", ["next_attempt_at"])
    op.create_index(op.f("ix_deliveries_delivered_at_next_attempt_at"), "deliveries",
                    ["delivered_at", "next_attempt_at"])
    op.create_index(op.f("ix_deliveries_notifier_id"), "deliveries", ["notifier", "id"])
    op.create_table(
        "delivery_tries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("delivery_id", sa.Integer(), nullable=False),
        sa.Column("agent_id", sa.String(64), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("outcome", sa.Enum(*OUTCOMES, name="try_outcome", native_enum=False,
                                     create_constraint=True, length=16), nullable=True),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["delivery_id"], ["deliveries.id"], ondelete="CASCADE",
                                name=op.f("fk_delivery_tries_delivery_id_deliveries")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delivery_tries")),
        sqlite_autoincrement=True)
    op.create_index(op.f("ix_delivery_tries_delivery_id"), "delivery_tries", ["delivery_id"])
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute(VIEW_0025)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute(VIEW_0021)
    op.drop_table("delivery_tries")
    op.drop_table("deliveries")
    op.drop_table("notify_on")
    op.drop_table("notifiers")
