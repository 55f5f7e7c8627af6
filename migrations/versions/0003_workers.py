"""Workers: restart policy, recycling and converging on hosts; the captured build a start
must exec on wakes; a one-shot run's clean exit on attempts and builds.

Only columns are added (every existing row keeps its values, the new columns take their
defaults) and the pending_obligations view is left as it is. Every batch here runs with
recreate="never": SQLite adds and drops these columns with plain ALTER TABLE (3.35+), so
no table is rebuilt, which with foreign keys on would fail on the tables other rows point
at (hosts, builds). For the same reason wakes.build_id carries no foreign key: SQLite
cannot drop a column that has one without a rebuild. Builds are never deleted as rows
(gc only marks them), so the reference cannot dangle.

Revision ID: 0003
Revises: 0001
Create Date: 2026-11-29 19:00:00
"""
import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0001'
branch_labels = None
depends_on = None


def _hosts() -> list[sa.Column]:  # type: ignore[type-arg]
    return [
        sa.Column('one_shot', sa.Boolean(), server_default=sa.text('(false)'), nullable=False),
        sa.Column('max_run', sa.Float(), nullable=True),
        sa.Column('restart_floor', sa.Float(), server_default='1.0', nullable=False),
        sa.Column('restart_cap', sa.Float(), server_default='30.0', nullable=False),
        sa.Column('restart_reset', sa.Float(), server_default='60.0', nullable=False),
        sa.Column('converge_grace', sa.Float(), server_default='60.0', nullable=False),
        sa.Column('restart_streak', sa.Integer(), server_default='0', nullable=False),
        sa.Column('drift_since', sa.DateTime(), nullable=True),
    ]


def _others() -> list[tuple[str, sa.Column]]:  # type: ignore[type-arg]
    return [
        ('wakes', sa.Column('build_id', sa.Integer(), nullable=True)),
        ('attempts', sa.Column('clean_exit', sa.Boolean(), nullable=True)),
        ('builds', sa.Column('good_at', sa.DateTime(), nullable=True)),
    ]


def upgrade() -> None:
    with op.batch_alter_table('hosts', recreate='never') as batch_op:
        for col in _hosts():
            batch_op.add_column(col)
    for table, col in _others():
        with op.batch_alter_table(table, recreate='never') as batch_op:
            batch_op.add_column(col)


def downgrade() -> None:
    for table, col in reversed(_others()):
        with op.batch_alter_table(table, recreate='never') as batch_op:
            batch_op.drop_column(col.name)
    with op.batch_alter_table('hosts', recreate='never') as batch_op:
        for col in reversed(_hosts()):
            batch_op.drop_column(col.name)
