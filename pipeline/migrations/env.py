"""Alembic environment for docpipe's packaged migrations (run by `docpipe db upgrade` / `Database.upgrade`)."""
from __future__ import annotations

from alembic import context
from sqlalchemy import text

from pipeline.db import make_engine
from pipeline.models import Base

MIGRATION_LOCK_KEY = 0x646F6370  # "docp": an arbitrary constant shared by every docpipe process
config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # Our own engine factory: the same SQLite pragmas (foreign keys, WAL) apply while migrating.
    url = config.get_main_option("sqlalchemy.url")
    if url is None:  # pipeline.db.migrate always sets it
        raise RuntimeError("alembic: sqlalchemy.url is not set; migrate through pipeline.db")
    engine = make_engine(url)
    with engine.connect() as connection:
        # render_as_batch: SQLite cannot ALTER most things in place; batch mode rebuilds tables for it.
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # Many workers start at once and each upgrades: one at a time, the others then find nothing to do.
                # (SQLite needs nothing: our connections begin with BEGIN IMMEDIATE, which serialises them.)
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
