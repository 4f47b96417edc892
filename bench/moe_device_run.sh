#!/usr/bin/env bash
# One device call for the CUDA MoE path (issue 17), run from a snapshot of a commit (the shared working tree may
# hold other sessions' half-done edits). Prepare here:
#   mkdir -p .snap_moe && git archive <commit> > .snap_moe/moe.tar
# then run with carry [".snap_moe", ".whl14"]:  bash bench/moe_device_run.sh <commit> [rerun seed]
# Order: the correctness checks in parallel (check_moe kernels and model on one fresh seed; with a rerun seed, the
# model part again on that seed with DOCPIPE_CUDA_GRAPHS=0 and =1), then the 35b-a3b layer timing alone on the card.
# Each part has its own time limit (CHECK_S / BENCH_S) and log (all joined in $OUT/logs.txt), so a part that runs
# long leaves the others' results; $OUT holds 7 files (the device brings back 8 at most).
set -u
OUT=${OUT:-/tmp/out}
REPO=$PWD
commit=${1:-unknown}
rerun=${2:-}
rm -rf /tmp/snap_moe && mkdir -p /tmp/snap_moe && tar -xf "$REPO/.snap_moe/moe.tar" -C /tmp/snap_moe || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl14/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/snap_moe PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=3
cd /tmp/snap_moe || exit 1
seed=$(python3 -c "import secrets; print(secrets.randbits(31))")
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
    date -u +%FT%TZ
    echo "commit $commit, fresh seed $seed, rerun seed ${rerun:-none}"
} | tee "$OUT/card.txt"
LOGS=/tmp/moe_logs  # joined into $OUT/logs.txt at the end: $OUT brings back at most 8 files
rm -rf "$LOGS" && mkdir -p "$LOGS"
run_part() {  # name, limit, command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    echo "== $name: rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/card.txt"
}
check="python3 -m tests.cuda_runner.check_moe"
run_part check_kernels "${CHECK_S:-40}" $check --part kernels --seed "$seed" --json "$OUT/check_kernels.json" &
run_part check_model "${CHECK_S:-40}" $check --part model --seed "$seed" --json "$OUT/check_model.json" &
if [ -n "$rerun" ]; then
    for g in 0 1; do
        run_part "rerun_graphs$g" "${CHECK_S:-40}" env DOCPIPE_CUDA_GRAPHS=$g $check --part model --seed "$rerun" \
            --json "$OUT/rerun_graphs$g.json" &
    done
fi
wait
OMP_NUM_THREADS=8 run_part bench "${BENCH_S:-30}" python3 bench/moe_layer_bench.py --json "$OUT/moe_bench.json" \
    --reps 15
for f in "$LOGS"/*.log; do
    echo "==== $(basename "$f")" >>"$OUT/logs.txt"
    cat "$f" >>"$OUT/logs.txt"
done
for f in "$LOGS"/check_*.log "$LOGS"/rerun_*.log; do
    [ -f "$f" ] || continue
    echo "-- $(basename "$f")"
    grep -E "Traceback|Error" "$f" | head -n 5
    grep -E "^row: model|FAIL|passed|SKIP" "$f" | tail -n 12
done
tail -n 30 "$LOGS/bench.log"
cat "$OUT/card.txt"
