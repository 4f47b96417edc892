"""Prometheus metrics: HTTP traffic measured here, pipeline and engine figures read at scrape time.

Job states, queue depth, pages/s and tokens/s are computed from the database when Prometheus scrapes, so they are
true for the whole deployment (embedded thread or any number of Celery workers), not just for this process.
Engine figures (batch size, cache use, TTFT and latency percentiles, prefill/decode token counters) exist only
where an engine runs in this process.

Who sees what: an admin key (or a server without keys) scrapes everything above. A tenant's key gets the same job,
queue, page and token figures counted over its tenant's documents only (`tenant_metrics`), and none of the
deployment's own figures (HTTP traffic, the engine, this server's in-process queue), which would show other
tenants' activity.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import Scope

from pipeline.db import Database
from pipeline.models import Document, Result
from pipeline.queries import count_jobs_by_state
from pipeline.tenancy import EVERYONE, Access

RATE_WINDOW_S = 60.0


@dataclass
class PipelineSnapshot:
    jobs_by_state: dict[str, int]
    pages_per_s: float
    tokens_per_s: float


def pipeline_snapshot(db: Database, window_s: float = RATE_WINDOW_S, access: Access = EVERYONE) -> PipelineSnapshot:
    """The pipeline's figures over the documents `access` sees (every tenant's by default)."""
    since = datetime.now(timezone.utc) - timedelta(seconds=window_s)
    recent = (select(func.count(), func.coalesce(func.sum(Result.completion_tokens), 0))
              .where(Result.created_at >= since, Result.unit != "document"))
    if not access.admin:
        recent = recent.join(Document, Document.id == Result.document_id).where(access.owns(Document.tenant))
    with db.read_session() as s:
        states = count_jobs_by_state(s, access)  # the read model's one count (every state)
        pages, tokens = s.execute(recent).one()
    return PipelineSnapshot(
        jobs_by_state=states,
        pages_per_s=pages / window_s,
        tokens_per_s=float(tokens) / window_s,
    )


# Engine figures exported when an engine runs in this process: stats() key -> (metric name, help).
ENGINE_GAUGES = {
    "running": ("docpipe_engine_batch_size", "Sequences in the engine's running batch"),
    "waiting": ("docpipe_engine_waiting", "Requests waiting for the engine"),
    "kv_usage": ("docpipe_engine_kv_cache_usage", "Fraction of KV cache blocks in use"),
    "ttft_p50_s": ("docpipe_engine_ttft_p50_seconds", "Time to first token, median of recent requests"),
    "ttft_p95_s": ("docpipe_engine_ttft_p95_seconds", "Time to first token, 95th percentile of recent requests"),
    "latency_p50_s": ("docpipe_engine_latency_p50_seconds", "Request latency, median of recent requests"),
    "latency_p95_s": ("docpipe_engine_latency_p95_seconds", "Request latency, 95th percentile of recent requests"),
    "spec_acceptance_rate": ("docpipe_engine_spec_acceptance_rate",
                             "Speculative decoding: accepted / verified drafts since start"),
    "spec_mean_accepted_length": ("docpipe_engine_spec_mean_accepted_length",
                                  "Speculative decoding: tokens one verify window adds on average (drafts + 1)"),
}
# Monotonic counts: Prometheus' rate() of these gives prefill and decode tokens/s separately.
ENGINE_COUNTERS = {
    "prompt_tokens_computed": ("docpipe_engine_prefill_tokens",
                               "Prompt tokens run through the model (prefix-cache hits excluded)"),
    "decode_tokens": ("docpipe_engine_decode_tokens", "Tokens generated in single-token decode steps"),
    "prefix_hit_tokens": ("docpipe_engine_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    "preemptions": ("docpipe_engine_preemptions", "Sequences preempted for lack of cache"),
    "spec_draft_tokens": ("docpipe_engine_spec_draft_tokens", "Speculative drafts verified"),
    "spec_accepted_tokens": ("docpipe_engine_spec_accepted_tokens", "Speculative drafts accepted"),
    "spec_verify_windows": ("docpipe_engine_spec_verify_windows", "Speculative verify windows run"),
    "spec_grammar_cut_tokens": ("docpipe_engine_spec_grammar_cut_tokens",
                                "Speculative drafts cut before verification because the grammar refused them"),
    "spec_auto_off_steps": ("docpipe_engine_spec_auto_off_steps",
                            "Steps where the cost rule left an auto request without drafts"),
    "spec_window_retries": ("docpipe_engine_spec_window_retries",
                            "Requests retried without drafts after their verify window failed in the runner"),
    "spec_room_cut_windows": ("docpipe_engine_spec_room_cut_windows",
                              "Sequences left without drafts: the runner could roll back no more windows that step"),
    "spec_auto_rest_skips": ("docpipe_engine_spec_auto_rest_skips",
                             "Auto requests not drafting in a step: their last drafts gained nothing (backoff)"),
}
FINISH_REASONS = ("stop", "length", "abort", "error")


def engine_metrics(stats: dict[str, Any]) -> Iterable[Metric]:
    """Prometheus families for an engine `stats()` dict; keys the engine does not report are left out."""
    for key, (name, doc) in ENGINE_GAUGES.items():
        if stats.get(key) is not None:
            yield GaugeMetricFamily(name, doc, value=float(stats[key]))
    for key, (name, doc) in ENGINE_COUNTERS.items():
        if stats.get(key) is not None:
            yield CounterMetricFamily(name, doc, value=float(stats[key]))
    finished = CounterMetricFamily("docpipe_engine_requests_finished", "Engine requests finished, by reason",
                                   labels=["reason"])
    for reason in FINISH_REASONS:
        if stats.get(f"finished_{reason}") is not None:
            finished.add_metric([reason], float(stats[f"finished_{reason}"]))
    yield finished


def pipeline_metrics(snap: PipelineSnapshot, scope: str) -> Iterable[Metric]:
    """The pipeline's families from a snapshot; `scope` says whose documents it counts (for the help text)."""
    jobs = GaugeMetricFamily("docpipe_jobs", f"Jobs by state ({scope}, from the database)", labels=["state"])
    for state, count in snap.jobs_by_state.items():
        jobs.add_metric([state], count)
    yield jobs
    yield GaugeMetricFamily("docpipe_queue_depth", f"Jobs waiting to run (state queued; {scope})",
                            value=snap.jobs_by_state.get("queued", 0))
    yield GaugeMetricFamily("docpipe_pages_per_second",
                            f"Page/segment results written per second over the last {RATE_WINDOW_S:.0f} s ({scope})",
                            value=snap.pages_per_s)
    yield GaugeMetricFamily("docpipe_tokens_per_second",
                            f"Generated tokens per second in extraction over the last {RATE_WINDOW_S:.0f} s "
                            f"({scope})", value=snap.tokens_per_s)


class _ScrapeCollector(Collector):
    def __init__(self, db: Database, local_queue: Callable[[], int],
                 engine_stats: Callable[[], dict[str, Any] | None]):
        self.db = db
        self.local_queue = local_queue
        self.engine_stats = engine_stats

    def collect(self) -> Iterable[Metric]:
        yield from pipeline_metrics(pipeline_snapshot(self.db), "whole deployment")
        yield GaugeMetricFamily("docpipe_embedded_queue_depth",
                                "Job ids waiting in this server's in-process worker queue", value=self.local_queue())
        stats = self.engine_stats()
        if stats is not None:
            yield from engine_metrics(stats)


class _TenantCollector(Collector):
    def __init__(self, db: Database, access: Access) -> None:
        self.db, self.access = db, access

    def collect(self) -> Iterable[Metric]:
        yield from pipeline_metrics(pipeline_snapshot(self.db, access=self.access), f"tenant {self.access.tenant}")


def tenant_metrics(db: Database, access: Access) -> bytes:
    """The exposition text a tenant's key scrapes: its tenant's pipeline figures only (see the module docstring)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_TenantCollector(db, access))
    return generate_latest(registry)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))

    def __post_init__(self) -> None:
        self.requests = Counter("docpipe_http_requests", "HTTP requests handled", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("docpipe_http_request_seconds", "Time to the response start", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    def watch(self, db: Database, local_queue: Callable[[], int],
              engine_stats: Callable[[], dict[str, Any] | None]) -> None:
        self.registry.register(_ScrapeCollector(db, local_queue, engine_stats))


class HttpMetrics:
    """Records requests by route template (not raw path: ids would explode the label set). The labelled children
    are kept here, so a request costs no label lookups under prometheus_client's lock."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._latency: dict[tuple[str, str], Any] = {}
        self._requests: dict[tuple[str, str, int], Any] = {}

    def response_started(self, method: str, route: str, seconds: float) -> None:
        child = self._latency.get((method, route))
        if child is None:
            child = self._latency[(method, route)] = self._metrics.latency.labels(method, route)
        child.observe(seconds)

    def finished(self, method: str, route: str, status: int) -> None:
        child = self._requests.get((method, route, status))
        if child is None:
            child = self._requests[(method, route, status)] = self._metrics.requests.labels(method, route,
                                                                                           str(status))
        child.inc()


def route_of(scope: Scope) -> str:
    """The matched route's template, or "unmatched" (refused before routing, or no route)."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
