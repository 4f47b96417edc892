#!/usr/bin/env bash
# One device call for bench/pipeline_throughput.py (issue 14, item 2) from a snapshot folder .snap_X holding:
#   x.tar.gz          git archive of the commit to run
#   whl/*.whl         .whl14's wheels (pymupdf, llguidance, nvmath, pydantic, SQLAlchemy, ...) + celery, kombu,
#                     billiard, vine, amqp, click*, prompt_toolkit, wcwidth, tzlocal, redis, alembic, Mako
#   redis-*.tar.xz    redis-server 7.0.15 (Debian 12) + the non-glibc libraries it links (lib/)
# Run as:  SNAP=.snap_X bash <(tar -xzOf .snap_X/x.tar.gz bench/pipeline_device_run.sh) [bench args...]
# Environment: TOTAL (seconds for the bench, default 205), DOCS, PAGES (per PDF), SHAPE, RUN_LIMIT, COMMIT (the
# archived commit, written into the JSON: the archive has no .git).
set -uo pipefail
SNAP=${SNAP:?the snapshot folder}
OUT=${OUT:-/tmp/out}
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$SNAP"/whl/*.whl || exit 1
rm -rf /tmp/s /tmp/w  # a warm machine keeps an earlier call's tree and databases: start from nothing
mkdir -p /tmp/s && tar -xzf "$SNAP"/x.tar.gz -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/site:/tmp/s PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DOCPIPE_BENCH_COMMIT=${COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader >"$OUT/gpu.txt" 2>&1
date -u +%FT%TZ >>"$OUT/gpu.txt"
archive=$(ls "$ROOT/$SNAP"/redis-*.tar.xz | head -n 1)
timeout -k 10 "${TOTAL:-205}" python3 bench/pipeline_throughput.py --runner cuda --shape "${SHAPE:-0.8b}" \
    --docs "${DOCS:-100}" --pages-per-doc "${PAGES:-10}" --run-limit-s "${RUN_LIMIT:-32}" --part-timeout 95 \
    --ingest-concurrency 8 --redis-archive "$archive" --workdir /tmp/w --json "$OUT/pipeline_throughput.json" "$@" \
    2>&1 | tee "$OUT/log"
rc=$?
for f in /tmp/w/engine.log /tmp/w/embedded.log /tmp/w/celery/gpu.log /tmp/w/celery/ingest.log; do
    [ -f "$f" ] && tail -c 1500000 "$f" >"$OUT/$(basename "$(dirname "$f")")_$(basename "$f")"
done
echo "exit code: $rc" | tee -a "$OUT/log"
