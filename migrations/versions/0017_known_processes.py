"""Descendants of a generation's leader seen by the descendant walk (issue 24 item 5): pid
and start time, so that one which leaves its cgroup and clears its environment is still a
process of the generation for the proof and `vigil check`. A new table; its rows go with
their generation (ON DELETE CASCADE: the history prune removes proven generations).

Revision ID: 0017
Revises: 0014
"""
import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "known_processes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
        sa.Column("seen_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["generation_id"], ["generations.id"],
                                name=op.f("fk_known_processes_generation_id_generations"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_known_processes")),
    )
    op.create_index("ix_known_processes_generation", "known_processes", ["generation_id"])


def downgrade() -> None:
    op.drop_index("ix_known_processes_generation", table_name="known_processes")
    op.drop_table("known_processes")
