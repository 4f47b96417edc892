"""transformers on the same card and config as our runner: prefill tok/s and decode tok/s at batch 1/8/32.

Parent side: `run_child(...)` starts this file as a child process per shape, so transformers and our runner never
share the card's memory, and returns the child's JSON (or {"error": ...}).

Child side (what runs on the card):
    python3 bench/hf_reference_bench.py --config '{"hidden_size": ...}' [--tied] [--device cuda]
        [--prefill 1024,8192] [--batches 1,8,32] [--context 1024] [--steps 6]

The model is Qwen3_5ForCausalLM built directly on the target device with bf16 as the default dtype, so
transformers' own init fills random weights there (no CPU copy, no float32 copy: a 27B-class model is ~54 GB).
No flash-linear-attention / causal-conv1d is expected: transformers' torch fallbacks run, which is what a user
without extra packages gets.
Timing goes through generate() (the user's path): a LogitsProcessor stamps the clock (after a device sync) each
time it is called, i.e. once after the prefill forward and once after every decode forward. Decode step time =
median of the gaps between stamps; prefill time = generate(max_new_tokens=1) as a whole, synchronised.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHILD_TIMEOUT_S = 300


@contextmanager
def born_bf16(device: str) -> Iterator[None]:
    """Modules built inside are created on `device` with bf16 parameters (transformers' init runs there: no float32
    model ever exists); the default dtype is restored on the way out, also after an error."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def build_model(text_config: dict[str, Any], tied: bool, device: str):
    """A random bf16 Qwen3_5ForCausalLM created on `device` (transformers' init runs there)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**{**text_config, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    with born_bf16(device):
        model = Qwen3_5ForCausalLM(cfg)
    return model.eval()


class _StepClock:
    """A LogitsProcessor that records the time of each call (after a device sync)."""

    def __init__(self, sync) -> None:
        self.sync = sync
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.sync()
        self.stamps.append(time.perf_counter())
        return scores


def measure(model, device: str, prefill: list[int], batches: list[int], context: int, steps: int,
            seed: int = 0) -> dict[str, Any]:
    """Prefill tok/s at each length (batch 1) and decode at each batch size (prompts of `context` tokens,
    1 + steps new tokens). Returns plain numbers (JSON-ready)."""
    import torch
    from transformers import LogitsProcessorList

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    vocab = model.config.vocab_size

    def ids(batch: int, length: int):
        return torch.randint(0, vocab, (batch, length), generator=gen).to(device)

    def generate(input_ids, new_tokens: int, clock: _StepClock | None = None) -> tuple[float, Any]:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, logits_processor=LogitsProcessorList([clock] if clock else []))
        sync()
        return time.perf_counter() - t0, out

    generate(ids(1, min(64, context)), 2)  # warm-up: kernels, cuBLAS heuristics, generate's own set-up
    out: dict[str, Any] = {}
    for length in prefill:
        runs = 3 if length <= 2048 else 1  # one long prefill: the whole thing must fit the device call
        times = [generate(ids(1, length), 1)[0] for _ in range(runs)]
        best = sorted(times)[len(times) // 2]
        out[f"prefill_{length}_s"] = best
        out[f"prefill_{length}_tok_s"] = length / best
    for batch in batches:
        clock = _StepClock(sync)
        total, result = generate(ids(batch, context), 1 + steps, clock)
        if tuple(result.shape) != (batch, context + 1 + steps):
            raise RuntimeError(f"generate returned {tuple(result.shape)}, expected {(batch, context + 1 + steps)}")
        gaps = sorted(b - a for a, b in zip(clock.stamps, clock.stamps[1:]))
        step = gaps[len(gaps) // 2]
        out[f"decode_b{batch}_ms"] = 1e3 * step
        out[f"decode_b{batch}_tok_s"] = batch / step
        out[f"decode_b{batch}_prefill_s"] = total - sum(gaps)  # prompt forward + generate's own set-up
    if device.startswith("cuda"):
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
    out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    return out


def run_child(text_config: dict[str, Any], tied: bool, *, prefill: list[int], batches: list[int], context: int,
              steps: int, device: str = "cuda", timeout_s: int = CHILD_TIMEOUT_S) -> dict[str, Any]:
    """Run this file as a child process (its own CUDA context and memory); its JSON, or {"error": ...}."""
    args = [sys.executable, str(Path(__file__).resolve()), "--config", json.dumps(text_config), "--device", device,
            "--prefill", ",".join(map(str, prefill)), "--batches", ",".join(map(str, batches)),
            "--context", str(context), "--steps", str(steps)] + (["--tied"] if tied else [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"transformers child timed out after {timeout_s} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:] or f"exit code {proc.returncode}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["child_wall_s"] = time.perf_counter() - t0
    return result


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="Qwen3_5TextConfig keyword arguments as JSON")
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefill", type=_ints, default=[1024, 8192], help="batch-1 prefill lengths")
    parser.add_argument("--batches", type=_ints, default=[1, 8, 32], help="decode batch sizes")
    parser.add_argument("--context", type=int, default=1024, help="prompt length of each decoded sequence")
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per batch size (>= 2)")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.context < 1 or min(args.batches + args.prefill, default=1) < 1:
        parser.error("--steps must be >= 2, --context, --batches and --prefill positive")
    import torch
    import transformers

    t0 = time.perf_counter()
    model = build_model(json.loads(args.config), args.tied, args.device)
    build_s = time.perf_counter() - t0
    result = {"torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
              "build_s": build_s, "context": args.context, "steps": args.steps,
              **measure(model, args.device, args.prefill, args.batches, args.context, args.steps)}
    if args.device.startswith("cuda"):
        result["device_name"] = torch.cuda.get_device_name()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
