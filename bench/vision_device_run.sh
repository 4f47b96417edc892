#!/usr/bin/env bash
# One device call for the vision tower (issue 14), run from a snapshot of a commit (the shared working tree may hold
# other sessions' half-done edits). Prepare here:
#   mkdir -p .snap_vis && git archive <commit> > .snap_vis/x.tar
# then run with carry [".snap_vis", ".whl14"]:  bash .snap_vis/run.sh  (a copy of this file, or tar -xOf it out)
# Order: check_vision_flash alone (every kernel the card has: the default and, on sm_90, wg64), then check_vision
# twice in parallel (the default variant; the default set to wg64, only if wg64 passed), then the tower profile alone
# on the card (variants m2n32, and wg64 if it passed). Every part has its own limit (FLASH_S, VISION_S, PROFILE_S),
# so one that runs long leaves the others' results; $OUT holds at most 8 files.
set -u
OUT=${OUT:-/tmp/out}
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$REPO"/.whl14/*.whl 2>/dev/null || exit 1
rm -rf /tmp/s && mkdir -p /tmp/s && tar -xf "$REPO/.snap_vis/x.tar" -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/tests/engine PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv | tee "$OUT/card.txt"
timeout "${FLASH_S:-35}" python3 -m tests.cuda_runner.check_vision_flash --json "$OUT/check_vision_flash.json" \
    > "$OUT/check_vision_flash.log" 2>&1
tail -8 "$OUT/check_vision_flash.log"
wg_ok=$(python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['results']
wg = [x for x in r if x['case'].startswith('wg64')]
print(int(bool(wg) and all(x['ok'] for x in wg)))" "$OUT/check_vision_flash.json" 2>/dev/null || echo 0)
echo "wg64 passed: $wg_ok"
timeout "${VISION_S:-45}" python3 -m tests.cuda_runner.check_vision --json "$OUT/check_vision.json" \
    > "$OUT/check_vision.log" 2>&1 &
if [ "$wg_ok" = 1 ]; then
    timeout "${VISION_S:-45}" python3 -c "
import runpy
import gpu_engine.cuda.vision_flash as vf
vf.DEFAULT_VARIANT = 'wg64'  # the towers of check_vision take the module default
runpy.run_module('tests.cuda_runner.check_vision', run_name='__main__')" --json "$OUT/check_vision_wg64.json" \
        > "$OUT/check_vision_wg64.log" 2>&1 &
fi
wait
tail -3 "$OUT/check_vision.log"; [ "$wg_ok" = 1 ] && tail -3 "$OUT/check_vision_wg64.log"
variants=m2n32; [ "$wg_ok" = 1 ] && variants=m2n32,wg64
timeout "${PROFILE_S:-50}" python3 bench/vision_tower_profile.py --json "$OUT/vision_tower_profile.json" \
    --variants "$variants" --photo-caps 3145728 --reps 2 2>&1 | tee "$OUT/profile.log" | grep -v "^attention"
