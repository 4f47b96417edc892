#!/usr/bin/env bash
# One device call: the GPU checks in parallel (they are correctness checks: sharing the card does not matter),
# then the operator benchmark alone on the card. Logs and JSON go to $OUT (at most 8 files come back).
#   bash bench/cuda_device_run.sh            (needs .whl/nvmath_python-*.whl carried, and $OUT set)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
date -u +%FT%TZ
T=${CHECK_TIMEOUT:-170}
timeout "$T" python3 -m tests.cuda_runner.check_vision --json "$OUT/cuda_vision.json" >"$OUT/vision.log" 2>&1 &
p1=$!
timeout "$T" python3 -m tests.cuda_runner.check_runner --json "$OUT/cuda_runner.json" >"$OUT/runner.log" 2>&1 &
p2=$!
timeout "$T" python3 -m tests.cuda_runner.check_hf_parity --json "$OUT/cuda_hf_parity.json" >"$OUT/hf.log" 2>&1 &
p3=$!
timeout "$T" python3 -m tests.cuda_runner.check_kernels --json "$OUT/cuda_check.json" >"$OUT/kernels.log" 2>&1 &
p4=$!
wait $p1; r1=$?
wait $p2; r2=$?
wait $p3; r3=$?
wait $p4; r4=$?
echo "exit codes: check_vision=$r1 check_runner=$r2 check_hf_parity=$r3 check_kernels=$r4"
date -u +%FT%TZ
timeout "${BENCH_TIMEOUT:-150}" python3 bench/cuda_operator_bench.py --json "$OUT/cuda_operator.json" ${BENCH_ARGS:-} \
    >"$OUT/bench.log" 2>&1
echo "exit code: cuda_operator_bench=$?"
date -u +%FT%TZ
for f in vision runner hf kernels bench; do
    echo "===== $f.log: $(grep -c PASS "$OUT/$f.log") PASS, $(grep -c -E 'FAIL|Traceback' "$OUT/$f.log") FAIL/Traceback"
    grep -E "FAIL|Traceback|Error" "$OUT/$f.log" | head -n 8
    grep -v -E "falling back to its reference|Writing model shards" "$OUT/$f.log" | tail -n "${TAIL:-12}"
done
# at most 8 files come back: one combined log next to the JSON files
for f in vision runner hf kernels bench; do
    echo "################ $f.log"
    cat "$OUT/$f.log"
done >"$OUT/all.log" 2>&1 && rm -f "$OUT"/{vision,runner,hf,kernels,bench}.log
