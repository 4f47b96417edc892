"""Fixtures for the pipeline tests: databases (SQLite file, PostgreSQL schema), the real bundled engine, inputs."""
from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from ci_rule import missing
from pipeline_test_support import FAST, PG_ADMIN_URL, make_own_inputs, sample_files

from pipeline.context import Pipeline
from pipeline.settings import Settings


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Every sample file (copied, so nothing a test does can touch samples/), or our own if samples/ is empty."""
    folder = tmp_path_factory.mktemp("inputs")
    found = sample_files()
    if not found:
        return make_own_inputs(folder)
    for f in found:
        shutil.copy(f, folder / f.name)
    return sorted(folder.iterdir())


@pytest.fixture(scope="session")
def engine_client() -> Iterator[Any]:
    """One real engine (bundled tiny model, reference runner) shared by the tests of this session."""
    from pipeline.engine_client import EngineClient

    client = EngineClient.from_settings(Settings(**FAST))
    yield client
    client.close()


def _pg_reachable() -> str | None:
    import psycopg

    try:
        with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=3"):
            return None
    except Exception as exc:  # any failure means: no usable server
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL schema in db `test` (other test suites share the database, never our schema)."""
    problem = _pg_reachable()
    if problem is not None:
        missing(f"PostgreSQL at 127.0.0.1:5432 (db test) is not reachable: {problem}")
    import psycopg

    schema = f"docpipe_pipeline_{secrets.token_hex(4)}"
    with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=test", autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{PG_ADMIN_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=test", autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'docpipe.sqlite'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def make_pipeline(tmp_path: Path) -> Iterator[Callable[..., Pipeline]]:
    made: list[Pipeline] = []

    def build(database_url: str | None = None, client: Any = None, **overrides: Any) -> Pipeline:
        settings = Settings(data_dir=tmp_path / "data", database_url=database_url, **{**FAST, **overrides})
        p = Pipeline(settings, client=client)
        made.append(p)
        return p

    yield build
    for p in made:
        p.close()
