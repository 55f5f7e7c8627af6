"""Scheduled restarts follow runners/agent/schedules.py's rename to jobstore.py (issue 38:
a module name in one layer only). As in 0013: APScheduler keeps each job's function by
textual reference inside its pickled state, and drops a job whose function it cannot
import, so `runners.agent.schedules:fire` becomes `runners.agent.jobstore:fire`. No schema
change; a row whose state cannot be read is left as it is.

Revision ID: 0034
Revises: 0033
"""
import pickle

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None

OLD = "runners.agent.schedules:fire"
NEW = "runners.agent.jobstore:fire"


def _repoint(old: str, new: str) -> None:  # 0013's, as it was (a revision stands alone)
    conn = op.get_bind()
    for job_id, blob in conn.execute(sa.text("SELECT id, job_state FROM apscheduler_jobs")).all():
        try:
            state = pickle.loads(blob)  # APScheduler's own format: it unpickles the same rows
        except Exception:  # noqa: BLE001 (not a pickle of a job: not ours to change)
            continue
        if not isinstance(state, dict) or state.get("func") != old:
            continue
        state["func"] = new
        conn.execute(sa.text("UPDATE apscheduler_jobs SET job_state = :s WHERE id = :i"),
                     {"s": pickle.dumps(state, pickle.HIGHEST_PROTOCOL), "i": job_id})


def upgrade() -> None:
    _repoint(OLD, NEW)


def downgrade() -> None:
    _repoint(NEW, OLD)
