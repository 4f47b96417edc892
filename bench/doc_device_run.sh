#!/usr/bin/env bash
# One device call for bench/doc_throughput.py, run from a snapshot of the committed tree (the shared working tree
# may hold other sessions' half-done edits). Prepare here:
#   git archive HEAD > .snap14/head.tar; (.whl14/: the wheels the machine lacks: nvmath-python, llguidance, pymupdf,
#   pillow-heif, filetype, jsonschema + referencing + rpds-py + jsonschema-specifications, pydantic + pydantic-core
#   + pydantic-settings + annotated-types + typing-inspection + python-dotenv, SQLAlchemy (pipeline.tenancy), ImageHash
#   (vision's video dedupe); pip download --python-version 3.12 as the device README says, versions from constraints.txt)
# then run with carry [".snap14", ".whl14"]:  bash bench/doc_device_run.sh "<commit>" "9b:fixed256,grammar:128" ...
# Each argument after the commit is shape:modes:units[:extra args], one bench process each, logs/JSON in $OUT.
# SNAP=<tar under .snap14/> picks another snapshot (default head.tar), TAG=<name> prefixes the output files, so one
# call can time two commits (before / after a change) on the same machine.
set -u
OUT=${OUT:-/tmp/out}
REPO=$PWD
commit=$1
shift
# A process an earlier call of the session left behind can hold most of the card (session 7: 121.8 GiB, and the
# engine's arena did not fit): every GPU compute process on a lent machine is this session's, so end them first.
leftover=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$leftover" ] && { echo "ending leftover GPU processes: $leftover"; kill -9 $leftover; sleep 2; }
rm -rf /tmp/snap && mkdir -p /tmp/snap && tar -xf "$REPO/.snap14/${SNAP:-head.tar}" -C /tmp/snap || exit 1
[ -d "$REPO/.snap14/overlay" ] && cp -r "$REPO/.snap14/overlay/." /tmp/snap/
[ -d /tmp/site/nvmath ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$REPO"/.whl14/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/snap PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4 DOCPIPE_BENCH_COMMIT=$commit
cd /tmp/snap || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | tee "$OUT/${TAG:-}card.txt"
date -u +%FT%TZ | tee -a "$OUT/${TAG:-}card.txt"
df -B1G --output=avail,target /dev/shm /tmp | tee -a "$OUT/${TAG:-}card.txt"
shm=$(df -B1G --output=avail /dev/shm | tail -1 | tr -d ' ')
n=0
for spec in "$@"; do
    n=$((n + 1))
    IFS=: read -r shape modes units extra <<<"$spec"
    work=/tmp/models
    if [ "${shm:-0}" -gt 70 ]; then work=/dev/shm/models; fi
    # shellcheck disable=SC2086
    timeout "${LIMIT:-400}" python3 bench/doc_throughput.py --runner cuda --shapes "$shape" --modes "$modes" \
        --units "$units" --workdir "$work" --json "$OUT/${TAG:-}doc_$n.json" $extra >"$OUT/${TAG:-}doc_$n.log" 2>&1
    rc=$?
    echo "== run $n ($spec): rc=$rc $(date -u +%T)" | tee -a "$OUT/${TAG:-}card.txt"
    grep -E "Traceback|Error|ceilings| units " "$OUT/${TAG:-}doc_$n.log" | tail -n 12
    rm -rf "$work"
    [ "$rc" = 0 ] || { tail -n 30 "$OUT/${TAG:-}doc_$n.log"; break; }  # the next shapes would fail the same way
done
