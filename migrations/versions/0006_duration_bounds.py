"""Every duration of a host is finite, above 0 and at most a day (86400 s): an `inf` drain
timeout never sent SIGKILL and held an agent's drive slot forever, and NaN compared false
with every bound.

PostgreSQL gets a CHECK constraint. SQLite can only add one by rebuilding `hosts`, whose
DROP TABLE would cascade-delete every row that references a host (foreign keys are on), so
there the same rule is two triggers (insert, update) that abort the statement as a CHECK
would (an IntegrityError either way). A row already out of bounds (written before this
revision) is clamped to a day first; NaN is stored as NULL by SQLite and is above every
number on PostgreSQL, so it is clamped too where the column allows it.

Revision ID: 0006
Revises: 0005
"""
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

DAY = 86400
COLUMNS = {"drain_timeout": False, "health_timeout": False, "max_run": True,
           "restart_floor": False, "restart_cap": False, "restart_reset": False,
           "converge_grace": False}  # name -> nullable
NAME = "ck_hosts_durations"


def _rule(prefix: str = "") -> str:
    parts = []
    for col, nullable in COLUMNS.items():
        c = prefix + col
        bound = f"{c} > 0 AND {c} <= {DAY}"
        parts.append(f"({c} IS NULL OR ({bound}))" if nullable else f"({bound})")
    return " AND ".join(parts)


def upgrade() -> None:
    for col in COLUMNS:
        op.execute(f"UPDATE hosts SET {col} = {DAY} WHERE {col} > {DAY}")
    if op.get_bind().dialect.name != "sqlite":
        op.create_check_constraint(op.f(NAME), "hosts", _rule())
        return
    raise_ = f"SELECT RAISE(ABORT, 'CHECK constraint failed: {NAME}');"
    op.execute(f"CREATE TRIGGER {NAME}_insert BEFORE INSERT ON hosts "
               f"WHEN NOT ({_rule('NEW.')}) BEGIN {raise_} END")
    op.execute(f"CREATE TRIGGER {NAME}_update BEFORE UPDATE OF {', '.join(COLUMNS)} ON hosts "
               f"WHEN NOT ({_rule('NEW.')}) BEGIN {raise_} END")


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f(NAME), "hosts", type_="check")
        return
    op.execute(f"DROP TRIGGER IF EXISTS {NAME}_insert")
    op.execute(f"DROP TRIGGER IF EXISTS {NAME}_update")
