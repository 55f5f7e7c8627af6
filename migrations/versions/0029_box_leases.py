"""Ownership per box (issue 28 item 2): one `box_leases` row per agent (holder, epoch,
expiry by the store's clock) renewed every few seconds by one UPDATE, and each host's lease
naming the box lease `epoch` it was taken under. A host's lease is valid while its
holder's box lease is live at that epoch; its row is written only on acquire, release and
takeover. A lease written before this revision has epoch 0: it is judged by its own
`expires_at`, as before, until its holder takes its first box lease and adopts it.
A new table, a column with a default and an index: nothing is rebuilt, every row stays.

Revision ID: 0029
Revises: 0026
"""
import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "box_leases",
        sa.Column("box", sa.String(length=64), nullable=False),
        sa.Column("epoch", sa.Integer(), server_default="0", nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("box", name="pk_box_leases"),
    )
    op.create_index("ix_box_leases_expires_at", "box_leases", ["expires_at"])
    with op.batch_alter_table("leases") as batch:
        batch.add_column(sa.Column("epoch", sa.Integer(), server_default="0", nullable=False))
    # The leases from before this revision, still judged by their own expiry, by expiry.
    op.create_index("ix_leases_epoch_expires_at", "leases", ["epoch", "expires_at"])


def downgrade() -> None:
    op.drop_index("ix_leases_epoch_expires_at", "leases")
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("epoch")
    op.drop_index("ix_box_leases_expires_at", "box_leases")
    op.drop_table("box_leases")
