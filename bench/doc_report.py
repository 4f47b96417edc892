"""One bench/doc_throughput.py mode's measurements as row fields: throughput, latency per unit kind, the limit model
over the steps this run scheduled, and where the wall time went (pure arithmetic, so the CPU tests check it).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from doc_outcomes import Outcome
from limit_model import ModelCost, limit_seconds
from step_profile import StepProfile
from stream_requests import percentiles


def report(outcomes: list[Outcome], wall: float, profile: StepProfile, cost: ModelCost,
           ceilings: dict[str, Any]) -> dict[str, Any]:
    """Throughput, latency, the limit model and the time split of one mode's run (pure arithmetic)."""
    n = len(outcomes)
    gen = sum(o.output.completion_tokens for o in outcomes)
    prompt = sum(o.output.prompt_tokens for o in outcomes)
    limit = limit_seconds(cost, (r.shape for r in profile.steps), gemm_flops_per_s=ceilings["gemm_flops_per_s"],
                          hbm_bytes_per_s=ceilings["hbm_bytes_per_s"])
    row: dict[str, Any] = {
        "units": n, "units_by_kind": {k: sum(o.unit.kind == k for o in outcomes) for k in ("pdf", "photo", "video")},
        "wall_s": wall, "pages_per_s": n / wall, "generated_tokens": gen, "prompt_tokens": prompt,
        "generated_tok_per_s": gen / wall, "prompt_tok_per_s": prompt / wall,
        "tokens_per_page": gen / n, "prompt_tokens_per_page": prompt / n,
        "t_limit_s": limit["t_limit_s"], "fraction_of_limit": limit["t_limit_s"] / wall, "limit": limit,
    }
    for label, group in (("all", outcomes), *((k, [o for o in outcomes if o.unit.kind == k])
                                              for k in ("pdf", "photo", "video"))):
        if not group:
            continue
        ttft = percentiles([o.first_token - o.submitted for o in group if o.first_token is not None])
        lat = percentiles([o.finished - o.submitted for o in group if o.finished is not None])  # drive waited for all
        row[f"latency_{label}"] = {"ttft_p50_s": ttft["p50"], "ttft_p95_s": ttft["p95"],
                                   "latency_p50_s": lat["p50"], "latency_p95_s": lat["p95"]}
    steps = profile.steps
    split = {
        "steps": len(steps),
        "vision_encode_s": sum(r.encode_s for r in steps),
        "prefill_forward_s": sum(r.forward_s for r in steps if r.has_prefill),
        "decode_forward_s": sum(r.forward_s for r in steps if not r.has_prefill),
        "grammar_mask_s": sum(r.mask_s for r in steps),
        "host_scheduling_s": sum(r.host_s for r in steps),
        "outside_steps_s": max(0.0, wall - sum(r.wall_s for r in steps)),
        "image_preprocessing_s": profile.prepare_s,  # on the submitting threads, overlapping the steps
        "image_preprocessing_count": profile.prepare_count,
    }
    split["runner_s"] = split["vision_encode_s"] + split["prefill_forward_s"] + split["decode_forward_s"]
    device = [r.device_s for r in steps if r.device_s is not None]
    if device:
        split["device_event_s"] = sum(device)
        split["device_event_decode_s"] = sum(r.device_s for r in steps if r.device_s is not None and not r.has_prefill)
        # the tower's GPU time (encodes return before it has run: vision_encode_s is their host enqueue time)
        split["vision_encode_device_s"] = sum(r.encode_device_s or 0.0 for r in steps)
    decode_steps = [r for r in steps if not r.has_prefill]
    if decode_steps:
        split["decode_step_mean_ms"] = 1e3 * split["decode_forward_s"] / len(decode_steps)
        split["decode_batch_mean"] = float(np.mean([len(r.shape.decode_contexts) for r in decode_steps]))
    row["time_split"] = split
    return row
