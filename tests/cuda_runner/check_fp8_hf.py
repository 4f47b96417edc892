"""The block-FP8 model on the GPU against transformers 5.17 loading the same official-layout files, and the accuracy
table (FP8 vs BF16) of both.

    python3 -m tests.cuda_runner.check_fp8_hf [--json out.json] [--seed N] [--hf-kernel DIR] [--cpu-harness]

Per config (check_runner's "small" and a wider "medium"; every Linear dimension below 128 or a multiple of it, which
transformers' FP8 integration needs), one random draw written twice by the same seed: the BF16 checkpoint
(gpu_engine/tiny.py) and its FP8 conversion in the official layout (gpu_engine/tiny_fp8.py). One token sequence:
a prefill of PREFILL tokens, then DECODE teacher-forced decode steps (ours: one chunk then one token a step, so both
the cuBLASLt and the streaming FP8 GEMMs run; transformers: one forward over the whole sequence). Six logit sets:
- truth: the reference runner in float32 on each checkpoint (FP8 weights dequantised exactly, no activation
  quantisation; test_fp8_transformers shows transformers dequantises our files to the same weights);
- transformers bf16 on each checkpoint (on the GPU its FP8Linear runs the fine-grained FP8 Triton kernel, which
  quantises activations per token and 128-group inside the GEMM);
- ours: the CUDA runner (bf16) on each checkpoint.
Pass: ours FP8 no farther from the FP8 truth than TRUTH_RATIO x transformers' FP8 run (the rule of check_fp8 and
the BF16 checks), the same for the BF16 pair, and transformers really ran FP8 (FP8Linear modules holding e4m3).
The table: top-1 agreement and logits rel-L2 of each engine's FP8 run against its own BF16 run and against the
float32 BF16 truth.

transformers loads that Triton kernel from the Hub (`kernels-community/finegrained-fp8`, through the `kernels`
package); the GPU machine is offline, so --hf-kernel names a folder holding that kernel's Python package
(`finegrained_fp8/`, the repository's torch-ext sources, not vendored here) and the check hands it to
transformers' kernel table itself, with one autotune config (no search: the config changes speed, not the math).
--cpu-harness: the numpy reference runner (with the FP8 activation emulation) as "ours", torch on the CPU (which
dequantises the FP8 files): checks this script's plumbing without a GPU.
Skips (exit 0) without a GPU, torch with CUDA, or transformers.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests.cuda_runner.check_fp8 import TRUTH_RATIO
from tests.cuda_runner.check_runner import CONFIGS
from tests.cuda_runner.harness import fresh_seed, rel_err, write_json

PREFILL, DECODE, BLOCK = 96, 32, 16
HF_CONFIGS = {
    "small": CONFIGS["small (hd 256, dk 128, M-RoPE 11/11/10)"],
    "medium": {
        "hidden_size": 512, "intermediate_size": 1536, "head_dim": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [6, 5, 5], "mrope_interleaved": True},
    },
}
KERNEL_PACKAGE = "finegrained_fp8"
KERNEL_NAME = "finegrained-fp8"  # transformers' key for it (integrations/hub_kernels.py)
_MODE = {"device": "cuda", "reference": False}


@dataclass
class Fp8ParityResult:
    case: str
    metric: str
    value: float
    bound: str
    ok: bool
    detail: dict = field(default_factory=dict)


def use_local_kernel(folder: str) -> str:
    """Hand transformers the fine-grained FP8 kernel from a local copy of its package (module docstring). The
    `_ops` module the kernel builder generates is written here: a torch.library namespace of our own."""
    import transformers.integrations.finegrained_fp8 as hf_fp8
    from transformers.integrations import hub_kernels

    staged = Path(tempfile.mkdtemp(prefix="hf_fp8_kernel_"))
    shutil.copytree(Path(folder) / KERNEL_PACKAGE, staged / KERNEL_PACKAGE)
    ops = staged / KERNEL_PACKAGE / "_ops.py"
    if not ops.exists():
        ops.write_text("import torch\n\nNAMESPACE = '_docpipe_finegrained_fp8'\n"
                       "ops = getattr(torch.ops, NAMESPACE)\n\n\n"
                       "def add_op_namespace_prefix(name: str) -> str:\n    return f'{NAMESPACE}::{name}'\n")
    sys.path.insert(0, str(staged))
    module = importlib.import_module(KERNEL_PACKAGE)
    kernel = module.matmul.w8a8_block_dynamic_fp8_matmul_kernel  # the 128x128-block dynamic path FP8Linear takes
    kernel.configs = [c for c in kernel.configs if c.num_warps == 4 and c.num_stages == 3][:1] or kernel.configs[:1]
    hub_kernels._KERNEL_MODULE_MAPPING[KERNEL_NAME] = module
    hf_fp8.is_kernels_available = lambda *a, **k: True  # the gate before the table lookup; `kernels` is not here
    return str(staged)


def _runner(config, weights, reference: bool, fp8_activations: bool = False):
    if reference:
        from gpu_engine.reference.runner import ReferenceRunner

        return ReferenceRunner(config, weights, fp8_activations=fp8_activations)
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner

    return CudaRunner(config, weights, CudaOptions(dtype="bf16", memory_budget=2 << 30))


def teacher_forced(runner, ids: np.ndarray, prefill: int) -> np.ndarray:
    """Logits at every position: one prefill chunk of `prefill` tokens, then one token a step."""
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    blocks = len(ids) // BLOCK + 2
    runner.allocate_cache(CacheSpec(num_kv_blocks=blocks, block_size=BLOCK, num_state_slots=1))
    table = np.arange(blocks, dtype=np.int32)

    def chunk(tok: np.ndarray, start: int, logits: str) -> StepBatch:
        pos = np.broadcast_to(np.arange(start, start + len(tok)), (3, len(tok))).astype(np.int64)
        return StepBatch([SeqChunk(0, tok, pos, start, table, 0, logits=logits)])

    try:
        rows = [runner.forward(chunk(ids[:prefill], 0, "all")).logits]
        rows += [runner.forward(chunk(ids[p:p + 1], p, "last")).logits for p in range(prefill, len(ids))]
    finally:
        if hasattr(runner, "close"):
            runner.close()
    return np.concatenate(rows).astype(np.float32)


def _hf_logits(folder: Path, ids: np.ndarray) -> tuple[np.ndarray, int, str]:
    """transformers bf16 logits over the whole sequence, the number of FP8Linear modules holding e4m3 and the dtype
    their scales were loaded in."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    dev = _MODE["device"]
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.bfloat16, device_map=dev).eval()
    fp8 = [m for m in hf.modules() if type(m).__name__ == "FP8Linear" and m.weight.dtype == torch.float8_e4m3fn]
    scale_dtype = str(fp8[0].weight_scale_inv.dtype) if fp8 else ""
    with torch.no_grad():
        logits = hf(input_ids=torch.from_numpy(ids)[None].to(dev)).logits[0].float().cpu().numpy()
    del hf
    if dev == "cuda":
        torch.cuda.empty_cache()
    return logits, len(fp8), scale_dtype


def _top1(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


def check_config(name: str, text_cfg: dict, seed: int, rng: np.random.Generator) -> tuple[list[Fp8ParityResult], dict]:
    from gpu_engine.config import ModelConfig
    from gpu_engine.loader import load_weights
    from gpu_engine.tiny import make_tiny_checkpoint
    from gpu_engine.tiny_fp8 import make_tiny_fp8_checkpoint

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folders = {"bf16": make_tiny_checkpoint(Path(tmp) / "bf16", seed=seed, dtype="bfloat16", text_config=text_cfg),
                   "fp8": make_tiny_fp8_checkpoint(Path(tmp) / "fp8", seed=seed, text_config=text_cfg)}
        config = ModelConfig.from_pretrained(folders["fp8"])
        ids = rng.integers(0, config.text.vocab_size, PREFILL + DECODE)
        logits: dict[str, dict[str, np.ndarray]] = {"truth": {}, "hf": {}, "ours": {}}
        fp8_modules, scale_dtype = 0, ""
        for kind, folder in folders.items():
            weights, _ = load_weights(folder, ModelConfig.from_pretrained(folder))
            logits["truth"][kind] = teacher_forced(_runner(config, weights, True), ids, PREFILL)
            emulate = _MODE["reference"] and kind == "fp8"  # the CPU harness's stand-in for the FP8 kernels
            logits["ours"][kind] = teacher_forced(_runner(config, weights, _MODE["reference"], emulate), ids, PREFILL)
            logits["hf"][kind], count, dtype = _hf_logits(folder, ids)
            if kind == "fp8":
                fp8_modules, scale_dtype = count, dtype
    truth = logits["truth"]
    table = {}
    for engine in ("ours", "hf"):
        run = logits[engine]
        table[engine] = {
            "top1_fp8_vs_own_bf16": _top1(run["fp8"], run["bf16"]),
            "rel_l2_fp8_vs_own_bf16": rel_err(run["fp8"], run["bf16"]),
            "top1_fp8_vs_f32_bf16": _top1(run["fp8"], truth["bf16"]),
            "rel_l2_fp8_vs_f32_bf16": rel_err(run["fp8"], truth["bf16"]),
            "rel_l2_fp8_vs_f32_fp8": rel_err(run["fp8"], truth["fp8"]),
            "rel_l2_bf16_vs_f32_bf16": rel_err(run["bf16"], truth["bf16"]),
        }
    table["truth"] = {"top1_fp8_vs_bf16": _top1(truth["fp8"], truth["bf16"]),
                      "rel_l2_fp8_vs_bf16": rel_err(truth["fp8"], truth["bf16"])}
    table["ours_vs_hf"] = {"fp8_rel_l2": rel_err(logits["ours"]["fp8"], logits["hf"]["fp8"]),
                           "fp8_top1": _top1(logits["ours"]["fp8"], logits["hf"]["fp8"])}
    results = []
    for kind in ("fp8", "bf16"):
        ours_d, hf_d = rel_err(logits["ours"][kind], truth[kind]), rel_err(logits["hf"][kind], truth[kind])
        ratio = ours_d / hf_d if hf_d > 0 else float("inf")
        results.append(Fp8ParityResult(
            f"{name} {kind}", "ours vs f32 truth / transformers'", ratio, f"<= {TRUTH_RATIO}",
            # the CPU harness compares the activation emulation with a dequantised transformers: plumbing only
            bool(np.isfinite(ratio) and (ratio <= TRUTH_RATIO or _MODE["reference"])),
            {"ours": ours_d, "transformers": hf_d}))
    ran_fp8 = fp8_modules > 0 or _MODE["reference"]  # the CPU harness: transformers dequantises (no GPU)
    results.append(Fp8ParityResult(f"{name} fp8", "transformers ran FP8Linear (e4m3)", float(fp8_modules), "> 0",
                                   ran_fp8, {"weight_scale_inv dtype": scale_dtype}))
    info = {"positions": PREFILL + DECODE, "prefill": PREFILL, "vocab": int(config.text.vocab_size),
            "hidden": int(config.text.hidden_size), "seconds": round(time.perf_counter() - t0, 2), **table}
    for r in results:
        print(f"{r.case:<14} {r.metric:<36} {r.value:.3g}  {'PASS' if r.ok else 'FAIL'}  {r.detail}", flush=True)
    return results, info


def markdown_table(tables: dict[str, dict]) -> str:
    """The README's accuracy table: per config, each engine's FP8 run vs its own BF16 run and vs the f32 BF16."""
    lines = ["| model | engine | top-1 vs own BF16 | rel-L2 vs own BF16 | top-1 vs f32 BF16 | rel-L2 vs f32 BF16 |",
             "|---|---|---|---|---|---|"]
    for name, t in tables.items():
        for engine, label in (("ours", "docpipe CUDA"), ("hf", "transformers 5.17")):
            e = t[engine]
            lines.append(f"| {name} | {label} | {e['top1_fp8_vs_own_bf16']:.3f} | {e['rel_l2_fp8_vs_own_bf16']:.3g} "
                         f"| {e['top1_fp8_vs_f32_bf16']:.3f} | {e['rel_l2_fp8_vs_f32_bf16']:.3g} |")
    return "\n".join(lines)


def _guarded(case: str, run) -> tuple[list[Fp8ParityResult], dict]:
    import traceback

    try:
        return run()
    except Exception:  # noqa: BLE001 - reported as a failure, the other config still runs
        text = traceback.format_exc()
        print(text, flush=True)
        return [Fp8ParityResult(case, "raised", float("nan"), "no exception", False, {"traceback": text[-3000:]})], {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--hf-kernel", default=os.environ.get("DOCPIPE_HF_FP8_KERNEL"),
                        help="folder holding the finegrained_fp8 kernel package (module docstring)")
    parser.add_argument("--cpu-harness", action="store_true", help="check this script on the CPU (docstring)")
    args = parser.parse_args(argv)
    if args.cpu_harness:
        _MODE.update(device="cpu", reference=True)
    else:
        from tests.cuda_runner.check_hf_parity import gpu_ready  # not at the top: it sets HF_HUB_OFFLINE, sys.path

        if not gpu_ready():
            return 0
    import torch
    import transformers

    if args.hf_kernel and not args.cpu_harness:
        print(f"transformers' FP8 kernel from {use_local_kernel(args.hf_kernel)}", flush=True)
    seed = fresh_seed(args.seed, bits=31)
    rng = np.random.default_rng(seed)
    results, tables = [], {}
    for name, text_cfg in HF_CONFIGS.items():
        rows, info = _guarded(name, lambda n=name, c=text_cfg: check_config(n, c, seed % 1000, rng))
        results += rows
        if info:
            tables[name] = info
    if tables:
        print(markdown_table(tables))
    print(f"seed {seed}: {sum(r.ok for r in results)}/{len(results)} passed")
    if args.json:
        write_json(args.json, {"seed": seed, "torch": torch.__version__, "transformers": transformers.__version__,
                               "mode": "cpu-harness" if args.cpu_harness else "gpu", "tables": tables,
                               "device": torch.cuda.get_device_name(0) if _MODE["device"] == "cuda" else "cpu"},
                   results)
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
