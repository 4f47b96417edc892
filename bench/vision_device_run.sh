#!/usr/bin/env bash
# One device call for the vision tower (issue 14), run from a snapshot of a commit (the shared working tree may hold
# other sessions' half-done edits). Prepare here:
#   mkdir -p .snap_vis && git archive <commit> > .snap_vis/x.tar
# then run with carry [".snap_vis", ".whl14"]:  bash bench/vision_device_run.sh
# Order: check_vision_flash alone (every kernel the card has: the default and, on sm_90, the wgmma variants), then
# check_vision in parallel for the default and with the default set to each wgmma variant that passed, then the tower
# profile alone on the card (m2n32 and the wgmma variants that passed). Every part has its own limit (FLASH_S,
# VISION_S, PROFILE_S), so one that runs long leaves the others' results. $OUT: card.txt, the JSON of each part and
# logs.txt (all logs joined: the device brings back 8 files at most).
set -u
OUT=${OUT:-/tmp/out}
REPO=$PWD
LOGS=/tmp/vision_logs
rm -rf "$LOGS" && mkdir -p "$LOGS"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl14/*.whl 2>/dev/null || exit 1
rm -rf /tmp/s && mkdir -p /tmp/s && tar -xf "$REPO/.snap_vis/x.tar" -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/tests/engine PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu,memory.used,memory.total --format=csv
  date -u +%FT%TZ; } | tee "$OUT/card.txt"
timeout "${FLASH_S:-35}" python3 -m tests.cuda_runner.check_vision_flash --json "$OUT/check_vision_flash.json" \
    > "$LOGS/1_check_vision_flash.log" 2>&1
tail -n 4 "$LOGS/1_check_vision_flash.log"
wg_ok=$(python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['results']
names = sorted({x['case'].split()[0] for x in r if x['case'].startswith('wg')})
print(','.join(n for n in names if all(x['ok'] for x in r if x['case'].split()[0] == n)))" \
    "$OUT/check_vision_flash.json" 2>/dev/null)
echo "wgmma variants that passed: ${wg_ok:-none}"
timeout "${VISION_S:-45}" python3 -m tests.cuda_runner.check_vision --json "$OUT/check_vision.json" \
    > "$LOGS/2_check_vision.log" 2>&1 &
for v in ${wg_ok//,/ }; do
    timeout "${VISION_S:-45}" python3 -c "
import runpy, sys
import gpu_engine.cuda.vision_flash as vf
vf.DEFAULT_VARIANT = sys.argv.pop(1)  # the towers of check_vision take the module default
runpy.run_module('tests.cuda_runner.check_vision', run_name='__main__')" "$v" --json "$OUT/check_vision_$v.json" \
        > "$LOGS/2_check_vision_$v.log" 2>&1 &
done
wait
for f in "$LOGS"/2_*.log; do echo "$f: $(tail -n 1 "$f")"; done
timeout "${PROFILE_S:-50}" python3 bench/vision_tower_profile.py --json "$OUT/vision_tower_profile.json" \
    --variants "m2n32${wg_ok:+,$wg_ok}" --reps 2 > "$LOGS/3_profile.log" 2>&1
grep -v "^attention" "$LOGS/3_profile.log" | tail -n 20
for f in "$LOGS"/*.log; do echo "==== $f"; cat "$f"; done > "$OUT/logs.txt"
