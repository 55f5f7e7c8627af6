"""Probes of the app's own: http:PATH, tcp, exec:CMD (issue 39, item 4).

Revision ID: 0036
Revises: 0035
"""
revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # filled in by the change that needs it


def downgrade() -> None:
    pass
