"""bench/step_host_cost.py: the CUDA runner's host work with the device stubbed out, counted per step."""
from __future__ import annotations

import step_host_cost as shc


def test_graphed_steps_replay_one_graph_and_eager_steps_launch_every_kernel():
    out = shc.measure(layers=4, rows=5, forced=2, forced_len=3, context=40, steps=2)
    graphed, eager, forced = (out["kinds"][k]["device_calls_per_step"] for k in ("graphed", "eager", "forced"))
    assert graphed.get("graph") == 1 and "launch" not in graphed and "gemm" not in graphed
    assert eager["launch"] > 4 * 5 and eager["gemm"] >= 4 * 3 + 1  # per layer: norms, mixer, MLP; the LM head
    assert forced["launch"] >= eager["launch"] and forced.get("gemm_plan", 0) == 0  # same token count: cached
    assert out["decode_counts"]["padded"] >= 2  # 5 rows replay the 8-row graph
    assert all(r["host_ms"] > 0 for r in out["kinds"].values())
