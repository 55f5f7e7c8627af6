"""The watchdog deadline of a generation (issue 39, item 3).

Revision ID: 0038
Revises: 0037
"""
revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # filled in by the change that needs it


def downgrade() -> None:
    pass
