#!/usr/bin/env bash
# One device call for #15 (FP8 weights), from the repository root of a snapshot:
#     bash bench/fp8_device_run.sh OUT_DIR BUDGET_S [HF_KERNEL_DIR]
# 1. the checks at once (GPU correctness only, so they may share the card): check_fp8 (fresh seed), check_runner,
#    check_fp8_hf (HF_KERNEL_DIR: the fine-grained FP8 kernel package for transformers, see its docstring);
# 2. then alone: fp8_gemm_bench (decode rows, norm+quant separate vs fused);
# 3. fp8_model_bench --with-bf16 at 27B in whatever is left of BUDGET_S.
# Everything lands in OUT_DIR: log plus one JSON per step (6 files).
set -u -o pipefail
out=${1:?OUT_DIR}
budget=${2:?BUDGET_S}
kernel=${3:-}
start=$SECONDS
tmp=$(mktemp -d)
timeout 60 python3 -m tests.cuda_runner.check_fp8 --json "$out/check_fp8.json" >"$tmp/fp8" 2>&1 &
p1=$!
timeout 60 python3 -m tests.cuda_runner.check_runner --json "$out/check_runner.json" >"$tmp/runner" 2>&1 &
p2=$!
timeout 60 python3 -m tests.cuda_runner.check_fp8_hf ${kernel:+--hf-kernel "$kernel"} \
    --json "$out/check_fp8_hf.json" >"$tmp/hf" 2>&1 &
p3=$!
wait $p1; r1=$?
wait $p2; r2=$?
wait $p3; r3=$?
for part in fp8 runner hf; do echo "==== check $part"; grep -v "Loading weights" "$tmp/$part" | tail -80; done
echo "checks: check_fp8 rc=$r1 check_runner rc=$r2 check_fp8_hf rc=$r3 at $((SECONDS - start)) s"
echo "==== fp8_gemm_bench"
timeout 40 python3 bench/fp8_gemm_bench.py --decode-only --json "$out/fp8_gemm_bench.json" 2>&1 | tail -40
echo "fp8_gemm_bench rc=$? at $((SECONDS - start)) s"
echo "==== fp8_model_bench --with-bf16"
left=$((budget - (SECONDS - start)))
[ "$left" -gt 20 ] || { echo "no time left for the model bench ($left s)"; exit 0; }
timeout "$left" python3 bench/fp8_model_bench.py --with-bf16 \
    --json "$out/fp8_model_bench.json" 2>&1 | grep -v '^ *"' | tail -30
echo "fp8_model_bench rc=$? at $((SECONDS - start)) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('vs_bf16'), indent=1))" \
    "$out/fp8_model_bench.json" 2>/dev/null
