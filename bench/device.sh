# Helpers for one call on the GPU machine (device tool). Source it, then:
#   setup                      install the carried wheels ($WHEELS, default .whl/*.whl) into /tmp/site, set PYTHONPATH,
#                              print the card
#   step NAME SECONDS CMD...   run CMD with a time limit; '@J' in CMD becomes $OUT/work/NAME.json; log in NAME.log
#   pack                       tar $OUT/work into $OUT/results.tgz (only 8 files come back; one archive holds all)
# Example: source bench/device.sh; setup; step flash 120 python3 -m tests.cuda_runner.check_flash --json @J; pack
# shellcheck shell=bash
OUT=${OUT:-/tmp/out}
WORK="$OUT/work"
mkdir -p "$WORK"

setup() {
    local wheels
    # shellcheck disable=SC2086
    wheels=$(ls ${WHEELS:-.whl/*.whl} 2>/dev/null)
    if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            $wheels || return 1
    fi
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=4
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$WORK/card.txt"
    date -u +%FT%TZ | tee -a "$WORK/card.txt"
}

step() {
    local name=$1 limit=$2
    shift 2
    local args=() a
    for a in "$@"; do args+=("${a//@J/$WORK/$name.json}"); done
    local t0=$SECONDS
    timeout "$limit" "${args[@]}" >"$WORK/$name.log" 2>&1
    local rc=$?
    printf '== %-14s rc=%-3s %4ss  PASS=%s FAIL=%s\n' "$name" "$rc" "$((SECONDS - t0))" \
        "$(grep -c PASS "$WORK/$name.log")" "$(grep -c -E 'FAIL|Traceback' "$WORK/$name.log")" | tee -a "$WORK/summary.txt"
    grep -E "FAIL|Traceback|Error" "$WORK/$name.log" | head -n 6
    tail -n "${TAIL:-8}" "$WORK/$name.log"
    return 0
}

pack() {
    date -u +%FT%TZ >>"$WORK/card.txt"
    tar -czf "$OUT/results.tgz" -C "$OUT" work && rm -rf "$WORK"
    cat "$OUT/results.tgz" | wc -c
}
