"""APScheduler's job store table, for scheduled restarts (`vigil schedule`).

Revision ID: 0005
Revises: 0001
Create Date: 2026-11-29 19:05:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The columns APScheduler 3.11's SQLAlchemyJobStore reads and writes, exactly.
    op.create_table('apscheduler_jobs',
    sa.Column('id', sa.Unicode(length=191), nullable=False),
    sa.Column('next_run_time', sa.Float(precision=25), nullable=True),
    sa.Column('job_state', sa.LargeBinary(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_apscheduler_jobs'))
    )
    with op.batch_alter_table('apscheduler_jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_apscheduler_jobs_next_run_time'), ['next_run_time'],
                              unique=False)


def downgrade() -> None:
    with op.batch_alter_table('apscheduler_jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_apscheduler_jobs_next_run_time'))
    op.drop_table('apscheduler_jobs')
