#!/usr/bin/env bash
# One device call for issue 14's decode kernels (session 7), from a snapshot of a commit. Prepare here:
#   mkdir -p .snap14d && git archive <commit> > .snap14d/x.tar   (carry [".snap14d", ".whl14"])
# then as the device command, from the repo root:
#   CAP=480 COMMIT=<commit> bash <(tar -xOf .snap14d/x.tar bench/decode_device_run.sh)
# Stages (each inside the call's CAP, the doc runs last, each given what is left, ~150 s each on a warm card):
#   check_kernels, check_decode_rows_apart, check_runner; cuda_decode_profile s6 vs s7 (9B, 192 rows, 4k / 8k);
#   the 9B document run (fixed256, 192 units, max-num-seqs 256, runner-sized cache) with the defaults, then with
#   DOCPIPE_CUDA_DECODE_ROWS_APART=1. Results in $OUT (at most 8 files).
set -o pipefail
T0=$SECONDS; CAP=${CAP:-480}; COMMIT=${COMMIT:-unknown}; R=$PWD
left() { echo $((CAP - (SECONDS - T0))); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl14/*.whl 2>/dev/null
rm -rf /tmp/s && mkdir -p /tmp/s && tar -xf .snap14d/x.tar -C /tmp/s && cd /tmp/s || exit 1
export PYTHONPATH=/tmp/site:/tmp/s:/tmp/s/tests/engine PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader  # must be ~0 MiB used
for c in check_kernels check_decode_rows_apart check_runner; do
    timeout 60 python3 -m tests.cuda_runner.$c --json $OUT/$c.json 2>&1 | tail -4; echo "== $c rc=$? t=$((SECONDS-T0))"
done
timeout 40 python3 bench/cuda_decode_profile.py --shape 9b --batches 192 --context 4096,8192 --fill random \
    --variants s6,s7 --steps 2 --json $OUT/decode_profile.json 2>&1 | grep -E "device time|paged_att|gated_delta"
mkdir -p /tmp/r/.snap14 && ln -sf $R/.snap14d/x.tar /tmp/r/.snap14/x.tar && ln -sf $R/.whl14 /tmp/r/.whl14
for tag in d_ a_; do  # d_: defaults; a_: decode rows apart
    L=$(( $(left) - 5 )); if [ "$tag" = d_ ]; then L=$(( L / 2 )); else export DOCPIPE_CUDA_DECODE_ROWS_APART=1; fi
    (cd /tmp/r && LIMIT=$L SNAP=x.tar TAG=$tag bash /tmp/s/bench/doc_device_run.sh "$COMMIT${DOCPIPE_CUDA_DECODE_ROWS_APART:+ +rows-apart}" \
        "9b:fixed256:192:--max-num-seqs 256 --kv-cache-gib 0") 2>&1 | grep -E "units|rc=" | tail -4
    rm -f $OUT/${tag}card.txt
done
