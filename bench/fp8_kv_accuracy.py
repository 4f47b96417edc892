"""FP8 (e4m3) KV cache accuracy by scale granularity, on the reference runner (numpy, CPU), issue 15 item 5.

    python3 bench/fp8_kv_accuracy.py [--seeds 0 1 2] [--tokens 32] [--json bench/results/fp8_kv_accuracy.json]

For each tiny random checkpoint (gpu_engine/tiny.py, one seed each) and each prompt (a long text chat message and
an image + text message), the same model runs with the normal float32 KV cache and with K / V stored as e4m3 under
three scale granularities of the full-attention layers' cache:
- token_head: one scale per (token, kv head), amax / 448, fixed when the token is written (the engine's
  kv_cache_dtype="fp8_e4m3", through gpu_engine.load);
- block_head: one scale per (cache block of block_size tokens, kv head); a write that raises the block's amax
  re-quantises the tokens the block already holds under the new scale (what a kernel would have to do; double
  rounding), so decode tokens can change earlier tokens' values;
- tensor_static: one scale per layer for K and one for V, calibrated on a different prompt (amax / 448) and fixed;
  values beyond it saturate at +-448 (a static-scale kernel's behaviour).
Measured against the normal-KV run of the same model: logits rel-L2 (||a - b|| / ||a||) at every prompt position
(one prefill) and at 32 teacher-forced decode steps (the normal run's greedy tokens), top-1 agreement over all those
positions, and free-running greedy agreement over 32 tokens (identical prefix length, out of 32).

Tiny random models amplify quantisation noise: head_dim 32 and random weights give flat, nearly tied logits (a small
perturbation flips the argmax far more often than in a trained model with confident predictions), so the agreement
numbers here are pessimistic; they rank the granularities, they do not predict a real checkpoint's accuracy.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_engine  # noqa: E402
from gpu_engine.fp8 import E4M3_MAX, e4m3_to_float32, float32_to_e4m3  # noqa: E402
from gpu_engine.inputs import ProcessedPrompt  # noqa: E402
from gpu_engine.model import LoadedModel  # noqa: E402
from gpu_engine.tiny import make_tiny_checkpoint  # noqa: E402

VARIANTS = ("token_head", "block_head", "tensor_static")
Shape = tuple[int, int, int, int]
MakeArray = Callable[[int, str, Shape], Any]  # (layer, "k" | "v", shape) -> a cache array


class BlockScaledKv:
    """e4m3 K or V with one scale per (block, kv head); a larger amax re-quantises the block's held tokens."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.bits = np.zeros(shape, np.uint8)
        self.scale = np.ones((shape[0], shape[2]), np.float32)
        self.amax = np.zeros((shape[0], shape[2]), np.float32)

    def __setitem__(self, index: tuple[np.ndarray, np.ndarray], values: np.ndarray) -> None:
        blocks, offsets = index
        values = np.asarray(values, np.float32)
        for b in np.unique(blocks):
            rows = blocks == b
            amax = np.maximum(self.amax[b], np.abs(values[rows]).max(axis=(0, 2)))
            scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
            if (amax > self.amax[b]).any():  # rewrite held tokens under the new scale (unchanged heads: identity)
                held = e4m3_to_float32(self.bits[b]) * self.scale[b][None, :, None]
                self.bits[b] = float32_to_e4m3(held / scale[None, :, None])
            self.bits[b, offsets[rows]] = float32_to_e4m3(values[rows] / scale[None, :, None])
            self.scale[b], self.amax[b] = scale, amax

    def __getitem__(self, index: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        blocks, offsets = index
        return e4m3_to_float32(self.bits[blocks, offsets]) * self.scale[blocks][:, :, None]


class StaticScaledKv:
    """e4m3 K or V with one fixed scale for the whole layer; values beyond 448 * scale saturate."""

    def __init__(self, shape: Shape, scale: float) -> None:
        self.shape = shape
        self.bits = np.zeros(shape, np.uint8)
        self.scale = np.float32(scale)
        self.written = self.saturated = 0  # elements written / beyond the calibrated range (clipped)

    def __setitem__(self, index: tuple[np.ndarray, np.ndarray], values: np.ndarray) -> None:
        scaled = np.asarray(values, np.float32) / self.scale
        self.written += scaled.size
        self.saturated += int((np.abs(scaled) > E4M3_MAX).sum())
        self.bits[index] = float32_to_e4m3(scaled)

    def __getitem__(self, index: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        return e4m3_to_float32(self.bits[index]) * self.scale


class AmaxRecorder:
    """A float32 cache array that remembers the largest |value| written (calibration of the static scale)."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.data = np.zeros(shape, np.float32)
        self.amax = 0.0

    def __setitem__(self, index: tuple[np.ndarray, np.ndarray], values: np.ndarray) -> None:
        self.amax = max(self.amax, float(np.abs(values).max()))
        self.data[index] = values

    def __getitem__(self, index: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        return self.data[index]


def swap_cache(model: LoadedModel, make: MakeArray) -> None:
    """After each allocate_cache, the reference runner's full-attention K / V arrays become make(...)'s."""
    runner: Any = model.runner
    allocate = runner.allocate_cache

    def allocate_and_swap(spec: Any) -> None:
        allocate(spec)
        for store, kind in ((runner.k_cache, "k"), (runner.v_cache, "v")):
            for layer in store:
                store[layer] = make(layer, kind, store[layer].shape)

    runner.allocate_cache = allocate_and_swap


def forced_logits(model: LoadedModel, prompt: ProcessedPrompt, tokens: list[int]) -> np.ndarray:
    """Logits at every prompt position (one prefill) then at each teacher-forced decode step of `tokens`.
    Uses LoadedModel's one-sequence step helpers, as generate() does."""
    model._ensure_cache(len(prompt) + len(tokens))
    rows = [model.prefill(prompt, logits="all")]
    for j, token in enumerate(tokens[:-1]):
        index = len(prompt) + j
        positions = np.full((3, 1), index + prompt.rope_delta, dtype=np.int64)
        rows.append(model._step(np.array([token], np.int64), positions, index, "last", []))
    return np.concatenate(rows, axis=0)


def prompts(model: LoadedModel) -> dict[str, ProcessedPrompt]:
    """A long text message (README prose) and an image + text message (a deterministic textured image)."""
    from PIL import Image

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")[:2400]
    yy, xx = np.mgrid[0:112, 0:160]
    rng = np.random.default_rng(7)
    pixels = np.stack([(xx * 1.6) % 256, (yy * 2.3) % 256, (xx + yy) % 256], axis=-1) + rng.normal(0, 20, (112, 160, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    return {
        "text": model.prepare([{"role": "user", "content": text}]),
        "image": model.prepare([{"role": "user", "content": [
            {"type": "image", "image": image}, {"type": "text", "text": text[:600]}]}]),
    }


def calibrate(folder: Path, prompt: ProcessedPrompt) -> dict[tuple[int, str], float]:
    """Per layer and K / V: amax over a calibration prompt's cache writes, from the normal-KV model."""
    model = gpu_engine.load(folder)
    recorders: dict[tuple[int, str], AmaxRecorder] = {}

    def make(layer: int, kind: str, shape: Shape) -> AmaxRecorder:
        recorders[(layer, kind)] = AmaxRecorder(shape)
        return recorders[(layer, kind)]

    swap_cache(model, make)
    model.prefill(prompt, logits="last")
    return {key: r.amax for key, r in recorders.items()}


def variant_model(folder: Path, variant: str, calibration: dict[tuple[int, str], float],
                  static: list[StaticScaledKv]) -> LoadedModel:
    """The model with `variant`'s KV cache; the static arrays it makes are appended to `static` (saturation)."""
    if variant == "token_head":
        return gpu_engine.load(folder, kv_cache_dtype="fp8_e4m3")
    model = gpu_engine.load(folder)
    if variant == "block_head":
        swap_cache(model, lambda layer, kind, shape: BlockScaledKv(shape))
        return model

    def make(layer: int, kind: str, shape: Shape) -> StaticScaledKv:
        static.append(StaticScaledKv(shape, max(calibration[(layer, kind)], 1e-30) / E4M3_MAX))
        return static[-1]

    swap_cache(model, make)
    return model


def compare(ref: np.ndarray, got: np.ndarray, ref_tokens: list[int], got_tokens: list[int]) -> dict[str, float]:
    rel = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    same = np.array(ref_tokens) == np.array(got_tokens)
    prefix = int(np.argmin(same)) if not same.all() else len(same)
    return {"rel_l2_max": float(rel.max()), "rel_l2_mean": float(rel.mean()),
            "top1_agree": float((ref.argmax(axis=1) == got.argmax(axis=1)).mean()),
            "greedy_prefix": prefix, "greedy_equal": float(same.mean())}


def run(seeds: list[int], n_tokens: int, workdir: Path) -> list[dict[str, Any]]:
    rows = []
    for seed in seeds:
        folder = make_tiny_checkpoint(workdir / f"seed{seed}", seed=seed)
        normal = gpu_engine.load(folder)
        cases = prompts(normal)
        # the static scale is calibrated on another prompt: the text prompt's tokens in reverse order
        calibration = calibrate(folder, normal.text_prompt(cases["text"].token_ids[::-1].copy()))
        for name, prompt in cases.items():
            ref_tokens = greedy(normal, prompt, n_tokens)
            ref_logits = forced_logits(normal, prompt, ref_tokens)
            for variant in VARIANTS:
                static: list[StaticScaledKv] = []
                model = variant_model(folder, variant, calibration, static)
                got_tokens = greedy(model, prompt, n_tokens)
                got_logits = forced_logits(model, prompt, ref_tokens)
                written = sum(a.written for a in static)
                row = {"seed": seed, "prompt": name, "prompt_tokens": len(prompt), "variant": variant,
                       "n_tokens": n_tokens, **compare(ref_logits, got_logits, ref_tokens, got_tokens),
                       "saturated_fraction": sum(a.saturated for a in static) / written if written else 0.0}
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def greedy(model: LoadedModel, prompt: ProcessedPrompt, n_tokens: int) -> list[int]:
    """n_tokens free-running greedy tokens of a prepared prompt (vision included), no stop token: generate()'s loop
    (it takes messages or ids, not a prepared prompt)."""
    model._ensure_cache(len(prompt) + n_tokens)
    last = model.prefill(prompt, logits="last")[-1]
    out: list[int] = []
    while True:
        out.append(int(np.argmax(last)))
        if len(out) == n_tokens:
            return out
        index = len(prompt) + len(out) - 1
        positions = np.full((3, 1), index + prompt.rope_delta, dtype=np.int64)
        last = model._step(np.array([out[-1]], np.int64), positions, index, "last", [])[-1]


def _line(row: dict[str, Any]) -> str:
    return (f"{row['seed']:>4} {row['prompt']:<6} {row['prompt_tokens']:>6} {row['variant']:<14} "
            f"{row['rel_l2_max']:>10.2e} {row['rel_l2_mean']:>10.2e} {row['top1_agree']:>8.4f} "
            f"{row['greedy_prefix']:>4}/{row['n_tokens']:<3} {row['saturated_fraction']:>9.2e}")


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        out[variant] = {"rel_l2_max": max(r["rel_l2_max"] for r in mine),
                        "rel_l2_mean": float(np.mean([r["rel_l2_mean"] for r in mine])),
                        "top1_agree_min": min(r["top1_agree"] for r in mine),
                        "top1_agree_mean": float(np.mean([r["top1_agree"] for r in mine])),
                        "greedy_prefix_min": min(r["greedy_prefix"] for r in mine),
                        "greedy_equal_mean": float(np.mean([r["greedy_equal"] for r in mine]))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results/fp8_kv_accuracy.json")
    args = parser.parse_args()
    print(f"{'seed':>4} {'prompt':<6} {'tokens':>6} {'variant':<14} {'relL2 max':>10} {'relL2 mean':>10} "
          f"{'top1':>8} greedy    saturated")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.seeds, args.tokens, Path(tmp))
    table = summary(rows)
    print(f"\n{'variant':<14} {'relL2 max':>10} {'relL2 mean':>10} {'top1 min':>9} {'top1 mean':>9} "
          f"{'greedy prefix min':>17} {'greedy equal':>12}")
    for variant, s in table.items():
        print(f"{variant:<14} {s['rel_l2_max']:>10.2e} {s['rel_l2_mean']:>10.2e} {s['top1_agree_min']:>9.4f} "
              f"{s['top1_agree_mean']:>9.4f} {s['greedy_prefix_min']:>14}/{args.tokens:<2} "
              f"{s['greedy_equal_mean']:>12.4f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "command": "python3 bench/fp8_kv_accuracy.py " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
        "machine": "CPU, reference runner (numpy float32)", "tokens": args.tokens,
        "note": "tiny random models (gpu_engine/tiny.py) amplify quantisation noise: the numbers rank the "
                "granularities, they do not predict a trained checkpoint's accuracy",
        "summary": table, "rows": rows,
    }, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
