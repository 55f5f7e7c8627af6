"""A host's own stop signal and stop command (issue 39, item 1).

Revision ID: 0035
Revises: 0034
"""
revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # filled in by the change that needs it


def downgrade() -> None:
    pass
