"""`docpipe status`: queue depths from Redis, jobs by state from the database, beat and watch-folder activity."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.exceptions import RedisError
from sqlalchemy import func, select

from pipeline.context import Pipeline
from pipeline.models import Document, DocumentStatus
from pipeline.queries import jobs_by_state

from .beat import BEAT_LOCK_KEY
from .config import QUEUES
from .liveness import dead_owners, registered
from .markers import queue_keys, reply_text
from .watch import stats_key

_UNACKED = "unacked"  # kombu's Redis transport: messages delivered to a worker and not yet acknowledged


@dataclass
class QueueStatus:
    broker_ok: bool
    broker_error: str | None = None
    depths: dict[str, int] = field(default_factory=dict)  # messages waiting per queue
    unacked: int = 0  # delivered to a worker, not yet acknowledged (running, or held for a delayed retry)
    beat_holder: str | None = None
    watch: dict[str, dict[str, str]] = field(default_factory=dict)
    workers: dict[str, bool] = field(default_factory=dict)  # registered worker process (host:pid) -> heartbeat alive


@dataclass
class Status:
    queues: QueueStatus
    jobs_by_state: dict[str, int]  # every state, 0 when none (pipeline.queries.jobs_by_state)
    documents_unreadable: int  # files that failed at intake (no job; the reason is on the document row)


def queue_status(client: redis.Redis, watch_folders: list[Path]) -> QueueStatus:
    try:
        depths = {}
        for queue in QUEUES:
            depths[queue] = sum(int(client.llen(k)) for k in queue_keys(client, queue))
        holder = client.get(BEAT_LOCK_KEY)
        watch = {}
        for folder in watch_folders:
            raw = client.hgetall(stats_key(Path(folder).expanduser().resolve()))
            stats = {reply_text(k): reply_text(v) for k, v in raw.items()}
            if "last_scan" in stats:
                stats["last_scan_ago_s"] = f"{time.time() - float(stats['last_scan']):.0f}"
            watch[str(folder)] = stats
        owners = registered(client)
        dead = dead_owners(client, owners)
        return QueueStatus(True, None, depths, int(client.hlen(_UNACKED)), reply_text(holder) if holder else None,
                           watch, {owner: owner not in dead for owner in sorted(owners)})
    except RedisError as exc:
        return QueueStatus(False, f"{type(exc).__name__}: {exc}")


def documents_unreadable(p: Pipeline) -> int:
    with p.db.read_session() as s:
        return int(s.scalar(select(func.count()).select_from(Document)
                            .where(Document.status == DocumentStatus.failed.value)) or 0)


def collect(p: Pipeline, client: redis.Redis) -> Status:
    return Status(queue_status(client, list(p.settings.watch_folders)), jobs_by_state(p), documents_unreadable(p))
