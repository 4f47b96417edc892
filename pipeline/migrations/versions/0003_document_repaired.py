"""documents.repaired: the file was damaged and MuPDF rebuilt it (its pages may be incomplete)

Rows rendered before this revision take the flag from the metadata they already store.

Revision ID: 0003
Revises: 0002
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('documents', schema=None) as batch_op:
        batch_op.add_column(sa.Column('repaired', sa.Boolean(), nullable=False, server_default=sa.false()))
    documents = sa.table('documents', sa.column('id', sa.Integer), sa.column('repaired', sa.Boolean),
                         sa.column('media_metadata', sa.JSON))
    bind = op.get_bind()
    flagged = [row.id for row in bind.execute(sa.select(documents.c.id, documents.c.media_metadata))
               if isinstance(row.media_metadata, dict) and row.media_metadata.get('repaired')]
    if flagged:
        bind.execute(documents.update().where(documents.c.id.in_(flagged)).values(repaired=True))


def downgrade() -> None:
    with op.batch_alter_table('documents', schema=None) as batch_op:
        batch_op.drop_column('repaired')
