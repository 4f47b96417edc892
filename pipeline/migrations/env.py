"""Alembic environment for docpipe's packaged migrations (run by `docpipe db upgrade` / `Database.upgrade`)."""
from __future__ import annotations

from alembic import context

from pipeline.db import make_engine
from pipeline.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # Our own engine factory: the same SQLite pragmas (foreign keys, WAL) apply while migrating.
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        # render_as_batch: SQLite cannot ALTER most things in place; batch mode rebuilds tables for it.
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
