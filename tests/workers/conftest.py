from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness module next to this file

from workers_harness import (  # noqa: E402
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
