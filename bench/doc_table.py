"""How bench/doc_throughput.py rows print: a line per mode as it finishes, and the table at the end of the run
(the JSON holds every field; these show the few a reader compares).
"""
from __future__ import annotations

from typing import Any


def mode_line(r: dict[str, Any]) -> str:
    """The line printed after each mode, so a run cut short has said what it measured."""
    s, lat = r["time_split"], r["latency_all"]
    return (f"{r['shape']:>5} {r['output_mode']:<10} {r['units']:>4} units {r['wall_s']:7.2f} s  "
            f"{r['pages_per_s']:7.2f} pages/s  {r['generated_tok_per_s']:8.0f} gen tok/s  "
            f"{r['prompt_tok_per_s']:8.0f} prompt tok/s  {r['tokens_per_page']:6.0f} tok/page "
            f"({r['grammar_completed_before_length']} ended by the grammar)  "
            f"limit {r['fraction_of_limit']:.2f}  busy {r['gpu_busy_fraction']:.2f}  "
            f"TTFT p50/p95 {lat['ttft_p50_s']:.2f}/{lat['ttft_p95_s']:.2f} s  "
            f"latency p50/p95 {lat['latency_p50_s']:.2f}/{lat['latency_p95_s']:.2f} s  "
            f"[vision {s['vision_encode_s']:.1f} (GPU {s.get('vision_encode_device_s', float('nan')):.1f}) "
            f"prefill {s['prefill_forward_s']:.1f} "
            f"decode {s['decode_forward_s']:.1f} "
            f"mask {s['grammar_mask_s']:.1f} host {s['host_scheduling_s']:.1f} outside {s['outside_steps_s']:.1f} "
            f"preprocess {s['image_preprocessing_s']:.1f} s]")


def table(rows: list[dict[str, Any]]) -> str:
    """The summary printed at the end of a run: one line per row, failed rows with their error."""
    head = (f"{'shape':>5} {'mode':<10} {'units':>5} {'wall s':>7} {'pages/s':>8} {'gen tok/s':>9} {'tok/page':>8} "
            f"{'limit s':>7} {'of limit':>8} {'GPU busy':>8} {'TTFT p50':>8} {'lat p95':>8}")
    lines = [head]
    for r in rows:
        if "wall_s" not in r:
            lines.append(f"{r['shape']:>5} {r['output_mode']:<10} (failed: {r.get('error', '?')[:80]})")
            continue
        lat = r["latency_all"]
        lines.append(f"{r['shape']:>5} {r['output_mode']:<10} {r['units']:>5} {r['wall_s']:>7.2f} "
                     f"{r['pages_per_s']:>8.2f} {r['generated_tok_per_s']:>9.0f} {r['tokens_per_page']:>8.0f} "
                     f"{r['t_limit_s']:>7.2f} {r['fraction_of_limit']:>8.2f} {r['gpu_busy_fraction']:>8.2f} "
                     f"{lat['ttft_p50_s']:>8.2f} {lat['latency_p95_s']:>8.2f}")
    return "\n".join(lines)
