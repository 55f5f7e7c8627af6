"""Reload in place, an obligation row (issue 39, item 2).

Revision ID: 0039
Revises: 0038
"""
revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # filled in by the change that needs it


def downgrade() -> None:
    pass
