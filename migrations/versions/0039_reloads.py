"""Reload in place, an obligation row (issue 39, item 2): `hosts.reload_signal` ("HUP" for
every host written before) and `hosts.on_reload_fail` ("restart"), and the table `reloads`
(one row per `vigil reload`, open rows in pending_obligations).

The host columns are added in place (no rebuild of hosts); on SQLite the CHECK of
on_reload_fail is two triggers, as 0023 does for on_store_loss. The view is dropped and
created again with its new branch (as 0025 did); downgrade puts 0025's back.

Revision ID: 0039
Revises: 0038
"""
import sqlalchemy as sa
from alembic import op

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None

# Frozen copies of the view before and after this revision.
VIEW_0025 = """CREATE VIEW pending_obligations AS
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
UNION ALL
SELECT 'notification', 'notify ' || notifier, generation_id, since, attempts, next_attempt_at,
       last_error
  FROM deliveries WHERE delivered_at IS NULL
"""
VIEW_0039 = VIEW_0025 + """UNION ALL
SELECT 'reload', host, generation_id, since, attempts, next_attempt_at, last_error
  FROM reloads WHERE state IN ('queued', 'signalled')
"""
STATES = ("queued", "signalled", "done", "failed", "cancelled")
CHECK = "ck_hosts_on_reload_fail"
RULE = "{p}on_reload_fail IN ('restart', 'keep')"


def upgrade() -> None:
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.add_column(sa.Column("reload_signal", sa.String(length=16), nullable=False,
                                   server_default="HUP"))
        batch.add_column(sa.Column("on_reload_fail", sa.String(length=8), nullable=False,
                                   server_default="restart"))
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(CHECK, "hosts", RULE.format(p=""))
    else:
        raise_ = f"SELECT RAISE(ABORT, 'CHECK constraint failed: {CHECK}');"
        op.execute(f"CREATE TRIGGER {CHECK}_insert BEFORE INSERT ON hosts "
                   f"WHEN NOT ({RULE.format(p='NEW.')}) BEGIN {raise_} END")
        op.execute(f"CREATE TRIGGER {CHECK}_update BEFORE UPDATE OF on_reload_fail ON hosts "
                   f"WHEN NOT ({RULE.format(p='NEW.')}) BEGIN {raise_} END")
    op.create_table(
        "reloads",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("host", sa.String(63), nullable=False),
        sa.Column("state", sa.Enum(*STATES, name="reload_state", native_enum=False,
                                   create_constraint=True, length=16), nullable=False),
        sa.Column("signal", sa.String(16), nullable=False),
        sa.Column("fence", sa.Integer(), nullable=True),
        sa.Column("generation_id", sa.Integer(), nullable=True),
        sa.Column("signalled_at", sa.DateTime(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("attempt_id", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("since", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["host"], ["hosts.name"], ondelete="CASCADE",
                                name=op.f("fk_reloads_host_hosts")),
        sa.ForeignKeyConstraint(["generation_id"], ["generations.id"],
                                name=op.f("fk_reloads_generation_id_generations")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reloads")),
        sqlite_autoincrement=True)
    op.create_index(op.f("ix_reloads_next_attempt_at"), "reloads", ["next_attempt_at"])
    op.create_index(op.f("ix_reloads_generation_id"), "reloads", ["generation_id"])
    op.create_index("ix_reloads_state_next_attempt_at", "reloads", ["state", "next_attempt_at"])
    op.create_index("ix_reloads_host_id", "reloads", ["host", "id"])
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute(VIEW_0039)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS pending_obligations")
    op.execute(VIEW_0025)
    op.drop_table("reloads")
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(CHECK, "hosts", type_="check")
    else:
        op.execute(f"DROP TRIGGER IF EXISTS {CHECK}_insert")
        op.execute(f"DROP TRIGGER IF EXISTS {CHECK}_update")
    with op.batch_alter_table("hosts", recreate="never") as batch:
        batch.drop_column("on_reload_fail")
        batch.drop_column("reload_signal")
