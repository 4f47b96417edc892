from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
from ci_rule import missing

sys.path.insert(0, str(Path(__file__).parent))  # the harness module next to this file

from workers_harness import (
    REDIS_HOST,
    REDIS_PORT,
    Cluster,
    claim_redis_db,
    release_redis_db,
    require_redis,
)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A claimed, empty database of the machine's Redis, flushed afterwards."""
    require_redis()
    db = claim_redis_db()
    try:
        yield f"redis://{REDIS_HOST}:{REDIS_PORT}/{db}"
    finally:
        release_redis_db(db)


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(broker_url: str, **overrides: str) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster{len(made)}", broker_url, dict(overrides))
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop_all()


PG_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=3"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL schema in db `test` on 127.0.0.1:5432, dropped afterwards."""
    import psycopg

    try:
        with psycopg.connect(PG_DSN):
            pass
    except Exception as exc:  # any failure means: no usable server
        reason = f"PostgreSQL at 127.0.0.1:5432 (db test) is not reachable: {type(exc).__name__}: {exc}"
        missing(reason)
    schema = f"docpipe_workers_{secrets.token_hex(4)}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/test?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """None = the default SQLite file in the data dir; or a PostgreSQL schema."""
    return None if request.param == "sqlite" else request.getfixturevalue("pg_url")
