"""CPU tests of check_pipeline_cuda's parts: judging and comparing runs, the schema it reads, the `docpipe` command
it installs for an uninstalled checkout, and its throw-away Redis. The whole flow itself runs with
`python3 -m tests.cuda_runner.check_pipeline_cuda --out DIR --runners reference` (about 2 minutes here)."""
from __future__ import annotations

import os
import random
import shutil
import sqlite3
import string
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.cuda_runner.check_pipeline_cuda import EXTRACT_DONE, REPO, sample_files
from tests.cuda_runner.pipeline_results import DocRow, UnitRow, compare_runs, first_difference, problems
from tests.cuda_runner.pipeline_services import ServiceError, install_docpipe_command, redis_ping, start_redis


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + '{}":, ') for _ in range(n))


def _doc(rng: random.Random, name: str, pages: int) -> DocRow:
    units = [UnitRow(f"page:{i}", True, _text(rng, rng.randint(5, 40)), {"v": rng.random()}, None, rng.randint(1, 9))
             for i in range(pages)]
    merged = [UnitRow("document", True, None, {"total": rng.random(), "name": _text(rng, 8)}, None, 0)]
    return DocRow(name, rng.randint(1, 1000), "ingested", pages, None,
                  jobs=[{"id": 1, "state": "succeeded", "attempts": 1, "error": None}], merged=merged, units=units)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(random.SystemRandom().getrandbits(32))


def test_first_difference_matches_common_prefix(rng: random.Random) -> None:
    for _ in range(200):
        a = _text(rng, rng.randint(0, 12))
        b = a[: rng.randint(0, len(a))] + _text(rng, rng.randint(0, 4)) if rng.random() < 0.8 else a
        expect = None if a == b else len(os.path.commonprefix([a, b]))
        assert first_difference(a, b) == expect, (a, b)


def test_a_complete_run_has_no_problems(rng: random.Random) -> None:
    docs = [_doc(rng, n, rng.randint(1, 4)) for n in ("a.pdf", "b.jpg", "c.tif")]
    assert problems(docs, ["a.pdf", "b.jpg", "c.tif"]) == []


@pytest.mark.parametrize("breakage, expect", [
    ("missing", "c.tif: no document"),
    ("extra", "d.png: not sent, yet a document exists"),
    ("duplicate", "a.pdf: 2 documents, expected 1"),
    ("job_failed", "job 1 is failed: boom"),
    ("two_jobs", "2 jobs, expected 1"),
    ("two_merged", "2 merged result rows, expected exactly 1"),
    ("no_merged", "0 merged result rows, expected exactly 1"),
    ("page_missing", "unit results for"),
    ("page_failed", "page:0 failed: bad json"),
    ("document_failed", "document failed: unreadable"),
])
def test_each_broken_run_is_reported(rng: random.Random, breakage: str, expect: str) -> None:
    docs = [_doc(rng, n, rng.randint(2, 4)) for n in ("a.pdf", "b.jpg", "c.tif")]
    a = docs[0]
    if breakage == "missing":
        docs.pop()
    elif breakage == "extra":
        docs.append(_doc(rng, "d.png", 1))
    elif breakage == "duplicate":
        docs.append(replace(a, document_id=a.document_id + 1))
    elif breakage == "job_failed":
        a.jobs[0].update(state="failed", error="boom")
    elif breakage == "two_jobs":
        a.jobs.append(dict(a.jobs[0], id=2))
    elif breakage == "two_merged":
        a.merged.append(a.merged[0])
    elif breakage == "no_merged":
        a.merged.clear()
    elif breakage == "page_missing":
        a.units.pop()
    elif breakage == "page_failed":
        a.units[0] = replace(a.units[0], ok=False, error="bad json")
    elif breakage == "document_failed":
        a.status, a.error = "failed", "unreadable"
    found = problems(docs, ["a.pdf", "b.jpg", "c.tif"])
    assert any(expect in p for p in found), found


def test_compare_runs_counts_equal_units_and_finds_the_first_difference(rng: random.Random) -> None:
    a = [_doc(rng, n, rng.randint(2, 5)) for n in ("a.pdf", "b.jpg")]
    b = [replace(d, units=list(d.units), merged=[replace(m) for m in d.merged]) for d in a]
    assert [(c.merged_equal, c.units_equal, c.first_difference) for c in compare_runs(a, b)] == \
        [(True, len(d.units), None) for d in a]
    target = b[1]
    k = rng.randrange(len(target.units))
    old = target.units[k].raw_text or ""
    at = rng.randrange(len(old))
    target.units[k] = replace(target.units[k], raw_text=old[:at] + ("#" if old[at] != "#" else "$") + old[at + 1:])
    target.merged = [replace(target.merged[0], data={**target.merged[0].data, "total": -1.0})]
    rows = {c.name: c for c in compare_runs(a, b)}
    assert rows["a.pdf"].merged_equal and rows["a.pdf"].units_equal == len(a[0].units)
    assert not rows["b.jpg"].merged_equal
    assert rows["b.jpg"].units_equal == len(a[1].units) - 1
    assert rows["b.jpg"].first_difference == f"page:{k}: char {at}"


def test_read_run_columns_exist_in_the_migrated_schema(tmp_path: Path) -> None:
    """read_run selects these columns by name; a renamed column must fail here, not on the GPU machine."""
    from pipeline.db import Database

    Database(f"sqlite:///{tmp_path / 'docpipe.sqlite'}").upgrade("head")
    con = sqlite3.connect(tmp_path / "docpipe.sqlite")
    try:
        cols = {t: {r[1] for r in con.execute(f"PRAGMA table_info({t})")} for t in ("documents", "jobs", "results")}
    finally:
        con.close()
    assert {"id", "original_name", "status", "page_count", "error"} <= cols["documents"]
    assert {"id", "document_id", "state", "attempts", "error"} <= cols["jobs"]
    assert {"job_id", "unit", "ok", "raw_text", "data", "error", "completion_tokens", "page_index"} <= cols["results"]


def test_the_installed_command_loads_the_worker_plugin(tmp_path: Path) -> None:
    site, bin_dir = install_docpipe_command(REPO, tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    done = subprocess.run([str(bin_dir / "docpipe"), "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for command in ("process", "worker", "submit", "status"):
        assert command in done.stdout
    assert "could not load" not in done.stderr


def test_sample_files_leave_out_scripts_docs_and_videos(tmp_path: Path) -> None:
    for name in ("a.pdf", "b.JPG", "clip.mp4", "make.py", "README.md", ".hidden.png", "c.tif"):
        (tmp_path / name).write_bytes(b"x")
    assert [f.name for f in sample_files(tmp_path, include_video=False)] == ["a.pdf", "b.JPG", "c.tif"]
    assert [f.name for f in sample_files(tmp_path, include_video=True)] == ["a.pdf", "b.JPG", "c.tif", "clip.mp4"]


def test_extract_task_line_is_recognised() -> None:
    line = ("2026-11-30 08:19:30,001 INFO MainProcess celery.app.trace: Task docpipe.extract[job-7-ab12] succeeded "
            "in 1.25s: {'job_id': 7, 'state': 'succeeded', 'ran': True, 'note': None}")
    found = EXTRACT_DONE.findall(line + "\n" + line.replace("docpipe.extract", "docpipe.ingest"))
    assert found == ["{'job_id': 7, 'state': 'succeeded', 'ran': True, 'note': None}"]


def _redis_sources() -> list[tuple[str, dict[str, Path]]]:
    out = []
    if shutil.which("redis-server"):
        out.append(("PATH", {}))
    carried = sorted((REPO / ".redis").glob("redis-*.tar.xz"))
    if carried:
        out.append(("carried archive", {"archive": carried[0]}))
    return out


@pytest.mark.parametrize("source", _redis_sources() or [("none", None)], ids=lambda s: s[0])
def test_throwaway_redis_answers_and_stops(tmp_path: Path, source: tuple[str, dict[str, Path] | None]) -> None:
    if source[1] is None:
        pytest.skip("no redis-server on PATH and no carried .redis archive")
    service, port = start_redis(tmp_path, **source[1])
    try:
        assert redis_ping(port)
    finally:
        service.stop(grace=5)
    assert not redis_ping(port)


def test_missing_redis_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServiceError, match="no redis-server"):
        start_redis(tmp_path)


def test_driver_skips_without_gpu_unless_reference(tmp_path: Path) -> None:
    from tests.cuda_runner.check_pipeline_cuda import gpu_unavailable

    reason = gpu_unavailable()
    if reason is None:
        pytest.skip("a GPU is usable here: the skip path cannot be exercised")
    done = subprocess.run([sys.executable, "-m", "tests.cuda_runner.check_pipeline_cuda", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("SKIP:"), done.stdout + done.stderr
    assert "skipped" in (tmp_path / "summary.json").read_text()
