"""Scheduled restarts follow the code's move into subpackages (issue 26). APScheduler keeps
each job's function by textual reference inside its pickled state: `runners.schedules:fire`
is now `runners.agent.schedules:fire`. Left as it was, APScheduler would drop every stored
job whose function it cannot import the first time the agent loads it. No schema change;
a row whose state cannot be read is left as it is (APScheduler reads it the same way).

Revision ID: 0013
Revises: 0012
"""
import pickle

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

OLD = "runners.schedules:fire"
NEW = "runners.agent.schedules:fire"


def _repoint(old: str, new: str) -> None:
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
