"""A crash loop that gives up: the start limit and the failed host (issue 39, item 5).

Revision ID: 0037
Revises: 0036
"""
revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # filled in by the change that needs it


def downgrade() -> None:
    pass
