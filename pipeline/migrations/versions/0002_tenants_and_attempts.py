"""tenants (documents, batches, user schemas), render attempts, job runs and isolation

Documents become unique per (tenant, sha256) and schemas per (tenant, name, version); existing rows belong to the
default tenant (built-in schemas to none). `jobs.runs` takes over the fencing token from `attempts`, which now
counts only the runs charged to the job (see pipeline.attempts); `jobs.isolated` asks for the next run alone.

Revision ID: 0002
Revises: 0001
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('documents', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tenant', sa.String(length=64), nullable=False, server_default='default'))
        batch_op.add_column(sa.Column('render_attempts', sa.Integer(), nullable=False, server_default='0'))
        batch_op.drop_index('ix_documents_sha256')
        batch_op.create_index(batch_op.f('ix_documents_sha256'), ['sha256'], unique=False)
        batch_op.create_index(batch_op.f('ix_documents_tenant'), ['tenant'], unique=False)
        batch_op.create_unique_constraint('uq_documents_tenant_sha256', ['tenant', 'sha256'])
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tenant', sa.String(length=64), nullable=False, server_default='default'))
        batch_op.create_index(batch_op.f('ix_batches_tenant'), ['tenant'], unique=False)
    with op.batch_alter_table('schemas', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tenant', sa.String(length=64), nullable=False, server_default=''))
        batch_op.drop_constraint('uq_schemas_name_version', type_='unique')
        batch_op.create_unique_constraint('uq_schemas_tenant_name_version', ['tenant', 'name', 'version'])
        batch_op.create_index(batch_op.f('ix_schemas_tenant'), ['tenant'], unique=False)
    op.execute("UPDATE schemas SET tenant = 'default' WHERE NOT builtin")
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('runs', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('isolated', sa.Boolean(), nullable=False, server_default=sa.false()))
    op.execute("UPDATE jobs SET runs = attempts")


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('isolated')
        batch_op.drop_column('runs')
    with op.batch_alter_table('schemas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_schemas_tenant'))
        batch_op.drop_constraint('uq_schemas_tenant_name_version', type_='unique')
        batch_op.create_unique_constraint('uq_schemas_name_version', ['name', 'version'])
        batch_op.drop_column('tenant')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_batches_tenant'))
        batch_op.drop_column('tenant')
    with op.batch_alter_table('documents', schema=None) as batch_op:
        batch_op.drop_constraint('uq_documents_tenant_sha256', type_='unique')
        batch_op.drop_index(batch_op.f('ix_documents_tenant'))
        batch_op.drop_index(batch_op.f('ix_documents_sha256'))
        batch_op.create_index(batch_op.f('ix_documents_sha256'), ['sha256'], unique=True)
        batch_op.drop_column('render_attempts')
        batch_op.drop_column('tenant')
