#!/usr/bin/env bash
# One device call for the CUDA MoE path (issue 17), run from a snapshot of a commit (the shared working tree may
# hold other sessions' half-done edits). Prepare here:
#   mkdir -p .snap_moe && git archive <commit> > .snap_moe/moe.tar
# then run with carry [".snap_moe", ".whl14"]:  bash bench/moe_device_run.sh <commit>
# Order: the kernel checks (moe.cu alone), the 35b-a3b layer timing, then the tiny-model checks (which compile every
# decoder kernel family); each part has its own time limit (KERNELS_S / BENCH_S / MODEL_S) and log under $OUT, so
# a part that runs long leaves the others' results.
set -u
OUT=${OUT:-/tmp/out}
REPO=$PWD
commit=${1:-unknown}
rm -rf /tmp/snap_moe && mkdir -p /tmp/snap_moe && tar -xf "$REPO/.snap_moe/moe.tar" -C /tmp/snap_moe || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl14/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/snap_moe PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=8
cd /tmp/snap_moe || exit 1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
    date -u +%FT%TZ
    echo "commit $commit"
} | tee "$OUT/card.txt"
run_part() {  # name, limit, command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/card.txt"
}
run_part check_kernels "${KERNELS_S:-35}" python3 -m tests.cuda_runner.check_moe --part kernels \
    --json "$OUT/check_kernels.json"
run_part bench "${BENCH_S:-35}" python3 bench/moe_layer_bench.py --json "$OUT/moe_bench.json" --reps 15
run_part check_model "${MODEL_S:-65}" python3 -m tests.cuda_runner.check_moe --part model \
    --json "$OUT/check_model.json"
for f in check_kernels check_model; do
    grep -E "Traceback|Error" "$OUT/$f.log" | head -n 5
    grep -E "FAIL|passed|SKIP" "$OUT/$f.log" | tail -n 20
done
tail -n 5 "$OUT/bench.log"
cat "$OUT/card.txt"
