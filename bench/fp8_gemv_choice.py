"""Which streaming-kernel form (fp8_ops.GEMV_KERNELS) spends the least time over a 27B layer stack, from a
fp8_gemm_bench JSON: decode rows M = 1 and 8, each projection weighted by how many the 27B model has.

    python3 bench/fp8_gemv_choice.py fp8_gemm_bench.json   -> prints the times and DEPTH=<d> (0 without data)
"""
from __future__ import annotations

import json
import sys

# 27B: 64 layers, 48 DeltaNet (in_proj, out_proj) + 16 attention (qkv, o_proj); o_proj and out_proj share a shape
PER_MODEL = {"gate_up": 64, "down": 64, "in_proj": 48, "qkv": 16, "o_proj": 64}
FORMS = {0: "fp8_gemv", 4: "fp8_gemv4"}


def stack_us(rows: list[dict]) -> dict[int, float]:
    return {d: sum(PER_MODEL.get(r["proj"], 0) * r[f"{fam}_us"] for r in rows
                   if r["m"] in (1, 8) and f"{fam}_us" in r) for d, fam in FORMS.items()}


def main(argv: list[str]) -> int:
    cost = stack_us(json.load(open(argv[0]))["rows"])
    print("streaming-kernel time over the 27B layer stack, M=1 + M=8 (us):", cost)
    print(f"DEPTH={min(cost, key=cost.__getitem__) if all(cost.values()) else 0}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
