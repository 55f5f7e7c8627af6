"""The whole store: hosts, builds, generations, leases, every obligation table, events,
agents, and the pending_obligations view.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 16:00:07.553429
"""
import sqlalchemy as sa
from alembic import op

# Frozen copy of the view as this revision creates it; later revisions carry their own.
PENDING_OBLIGATIONS = '''CREATE VIEW pending_obligations AS
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
'''

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('agents',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('box', sa.String(length=255), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('create_time', sa.Float(), nullable=True),
    sa.Column('state_dir', sa.Text(), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(), nullable=True),
    sa.Column('stopped_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_agents'))
    )
    op.create_table('builds',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('published_at', sa.DateTime(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('deleted_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_builds')),
    sa.UniqueConstraint('path', name=op.f('uq_builds_path'))
    )
    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.DateTime(), nullable=False),
    sa.Column('host', sa.String(length=63), nullable=True),
    sa.Column('generation_id', sa.Integer(), nullable=True),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_host'), ['host'], unique=False)

    op.create_table('hosts',
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('kind', sa.Enum('instance', 'worker', name='host_kind', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('build_id', sa.Integer(), nullable=False),
    sa.Column('args', sa.Text(), nullable=False),
    sa.Column('env', sa.Text(), nullable=False),
    sa.Column('cwd', sa.Text(), nullable=True),
    sa.Column('drain_timeout', sa.Float(), nullable=False),
    sa.Column('health_timeout', sa.Float(), nullable=False),
    sa.Column('memory_tier_mb', sa.Integer(), nullable=True),
    sa.Column('desired', sa.Enum('up', 'down', name='desired', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('raised', sa.Boolean(), server_default=sa.text('(false)'), nullable=False),
    sa.Column('fence_seq', sa.Integer(), server_default='0', nullable=False),
    sa.Column('box', sa.String(length=255), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_hosts_build_id_builds')),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_hosts'))
    )
    op.create_table('generations',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('uuid', sa.String(length=36), nullable=False),
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('build_id', sa.Integer(), nullable=False),
    sa.Column('state', sa.Enum('spawning', 'running', 'current', 'retiring', 'proven', name='gen_state', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('fence', sa.Integer(), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=True),
    sa.Column('create_time', sa.Float(), nullable=True),
    sa.Column('cgroup', sa.Text(), nullable=True),
    sa.Column('socket', sa.Text(), nullable=True),
    sa.Column('agent_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('current_at', sa.DateTime(), nullable=True),
    sa.Column('ended_at', sa.DateTime(), nullable=True),
    sa.Column('end_reason', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_generations_build_id_builds')),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_generations_host_hosts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_generations')),
    sa.UniqueConstraint('uuid', name=op.f('uq_generations_uuid')),
    sqlite_autoincrement=True,
    )
    with op.batch_alter_table('generations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_generations_host'), ['host'], unique=False)
        batch_op.create_index('ux_generations_one_current', ['host'], unique=True, sqlite_where=sa.text("state = 'current'"), postgresql_where=sa.text("state = 'current'"))

    op.create_table('leases',
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('holder', sa.String(length=64), nullable=False),
    sa.Column('fence', sa.Integer(), nullable=False),
    sa.Column('acquired_at', sa.DateTime(), nullable=False),
    sa.Column('expires_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_leases_host_hosts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('host', name=op.f('pk_leases'))
    )
    op.create_table('releases',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('holder', sa.String(length=64), nullable=False),
    sa.Column('fence', sa.Integer(), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('since', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_releases_host_hosts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_releases'))
    )
    with op.batch_alter_table('releases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_releases_host'), ['host'], unique=False)
        batch_op.create_index(batch_op.f('ix_releases_next_attempt_at'), ['next_attempt_at'], unique=False)

    op.create_table('restores',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('fence', sa.Integer(), nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('since', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_restores_host_hosts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_restores'))
    )
    with op.batch_alter_table('restores', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_restores_host'), ['host'], unique=False)
        batch_op.create_index(batch_op.f('ix_restores_next_attempt_at'), ['next_attempt_at'], unique=False)

    op.create_table('attempts',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('build_id', sa.Integer(), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('cause', sa.Enum('release', 'retry', 'restart', 'config', name='cause', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('mode', sa.Enum('overlap', 'hold', name='mode', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('effective_mode', sa.Enum('overlap', 'hold', name='effective_mode', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('revision', sa.Integer(), nullable=False),
    sa.Column('canary', sa.Boolean(), nullable=False),
    sa.Column('step', sa.Enum('queued', 'admitted', 'raised', 'published', 'spawning', 'spawned', 'healthy', 'settled', 'stopping_old', 'switched', 'drained', 'ended', name='attempt_step', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('fence', sa.Integer(), nullable=True),
    sa.Column('successor_id', sa.Integer(), nullable=True),
    sa.Column('retiring_id', sa.Integer(), nullable=True),
    sa.Column('outcome', sa.Enum('done', 'failed', 'abandoned', 'cancelled', 'down', name='outcome', native_enum=False, create_constraint=True, length=16), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('executed', sa.Boolean(), nullable=True),
    sa.Column('drain_seconds', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('ended_at', sa.DateTime(), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('since', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['builds.id'], name=op.f('fk_attempts_build_id_builds')),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_attempts_host_hosts'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['retiring_id'], ['generations.id'], name=op.f('fk_attempts_retiring_id_generations')),
    sa.ForeignKeyConstraint(['successor_id'], ['generations.id'], name=op.f('fk_attempts_successor_id_generations')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempts'))
    )
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_attempts_host'), ['host'], unique=False)
        batch_op.create_index(batch_op.f('ix_attempts_next_attempt_at'), ['next_attempt_at'], unique=False)

    op.create_table('stops',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('state', sa.Enum('queued', 'signalled', 'done', 'cancelled', name='stop_state', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('fence', sa.Integer(), nullable=True),
    sa.Column('generation_id', sa.Integer(), nullable=True),
    sa.Column('signalled_at', sa.DateTime(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('ended_at', sa.DateTime(), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('since', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['generation_id'], ['generations.id'], name=op.f('fk_stops_generation_id_generations')),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_stops_host_hosts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_stops'))
    )
    with op.batch_alter_table('stops', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_stops_host'), ['host'], unique=False)
        batch_op.create_index(batch_op.f('ix_stops_next_attempt_at'), ['next_attempt_at'], unique=False)

    op.create_table('wakes',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('state', sa.Enum('queued', 'leased', 'spawning', 'checking', 'reaping', 'unproven', 'done', 'failed', 'cancelled', name='wake_state', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('cause', sa.String(length=16), nullable=False),
    sa.Column('fence', sa.Integer(), nullable=True),
    sa.Column('generation_id', sa.Integer(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('ended_at', sa.DateTime(), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('since', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['generation_id'], ['generations.id'], name=op.f('fk_wakes_generation_id_generations')),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_wakes_host_hosts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_wakes'))
    )
    with op.batch_alter_table('wakes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_wakes_host'), ['host'], unique=False)
        batch_op.create_index(batch_op.f('ix_wakes_next_attempt_at'), ['next_attempt_at'], unique=False)

    op.create_table('members',
    sa.Column('generation_id', sa.Integer(), nullable=False),
    sa.Column('host', sa.String(length=63), nullable=False),
    sa.Column('role', sa.Enum('spawning', 'successor', 'retiring', name='member_role', native_enum=False, create_constraint=True, length=16), nullable=False),
    sa.Column('attempt_id', sa.Integer(), nullable=True),
    sa.Column('fence', sa.Integer(), nullable=False),
    sa.Column('unproven', sa.Boolean(), nullable=False),
    sa.Column('retried_at', sa.DateTime(), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('since', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['attempt_id'], ['attempts.id'], name=op.f('fk_members_attempt_id_attempts')),
    sa.ForeignKeyConstraint(['generation_id'], ['generations.id'], name=op.f('fk_members_generation_id_generations')),
    sa.ForeignKeyConstraint(['host'], ['hosts.name'], name=op.f('fk_members_host_hosts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('generation_id', name=op.f('pk_members'))
    )
    with op.batch_alter_table('members', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_members_host'), ['host'], unique=False)
        batch_op.create_index(batch_op.f('ix_members_next_attempt_at'), ['next_attempt_at'], unique=False)


    op.execute(PENDING_OBLIGATIONS)

def downgrade() -> None:
    op.execute('DROP VIEW IF EXISTS pending_obligations')
    with op.batch_alter_table('members', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_members_next_attempt_at'))
        batch_op.drop_index(batch_op.f('ix_members_host'))

    op.drop_table('members')
    with op.batch_alter_table('wakes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_wakes_next_attempt_at'))
        batch_op.drop_index(batch_op.f('ix_wakes_host'))

    op.drop_table('wakes')
    with op.batch_alter_table('stops', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_stops_next_attempt_at'))
        batch_op.drop_index(batch_op.f('ix_stops_host'))

    op.drop_table('stops')
    with op.batch_alter_table('attempts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_attempts_next_attempt_at'))
        batch_op.drop_index(batch_op.f('ix_attempts_host'))

    op.drop_table('attempts')
    with op.batch_alter_table('restores', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_restores_next_attempt_at'))
        batch_op.drop_index(batch_op.f('ix_restores_host'))

    op.drop_table('restores')
    with op.batch_alter_table('releases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_releases_next_attempt_at'))
        batch_op.drop_index(batch_op.f('ix_releases_host'))

    op.drop_table('releases')
    op.drop_table('leases')
    with op.batch_alter_table('generations', schema=None) as batch_op:
        batch_op.drop_index('ux_generations_one_current', sqlite_where=sa.text("state = 'current'"), postgresql_where=sa.text("state = 'current'"))
        batch_op.drop_index(batch_op.f('ix_generations_host'))

    op.drop_table('generations')
    op.drop_table('hosts')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_host'))
        batch_op.drop_index(batch_op.f('ix_events_at'))

    op.drop_table('events')
    op.drop_table('builds')
    op.drop_table('agents')
