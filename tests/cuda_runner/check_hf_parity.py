"""Whole-model parity on the GPU: CudaRunner vs transformers' Qwen3_5ForConditionalGeneration on the same card.

    python3 -m tests.cuda_runner.check_hf_parity [--json out.json] [--skip-1b]

1. Tiny random config (built with transformers, weights at O(1) scales, saved and loaded by our loader), float32
   on both sides (TF32 off in torch): for a text prompt, one image and a video given as a frame list, the
   prompt's logits (one chunk, and chunks of 7 tokens) must be within rel-L2 1e-4 of transformers', and 16
   greedy tokens must be identical (ours decodes through its CUDA graphs). Then batched decode: two prompts
   prefilled in one step and decoded together for 12 steps; each sequence's greedy tokens must equal
   transformers' generate() on that prompt alone, and every decode step's logits must be within 1e-4.
2. A ~1B-parameter random config in bf16 (the 2B-class layer shapes, fewer layers, tied 248320-token vocabulary):
   256 positions (a 192-token prefill, then 64 teacher-forced decode steps); top-1 agreement with transformers
   bf16 on the same card must be >= 99%. The agreement of transformers bf16 with its own float32 run is printed
   as the noise floor of the comparison.
Skips (exit 0) without a GPU, torch with CUDA, or transformers.

--cpu-harness runs the same scenarios with the numpy ReferenceRunner and torch on the CPU, with a smaller
"large" config: it checks this harness itself (indexing, token alignment) on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers may look for hub kernels; the GPU machine is offline
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # engine_hf_models (tiny HF configs)

from engine_hf_models import build_hf_vlm_checkpoint, hf_vlm_inputs, random_frames

from tests.cuda_runner.harness import fresh_seed, rel_err, write_json

LOGIT_TOL = 1e-4
_MODE = {"device": "cuda", "reference": False}  # --cpu-harness: "cpu" and the numpy ReferenceRunner
TOP1_MIN = 0.99
GREEDY_TOKENS = 16


@dataclass
class ParityResult:
    case: str
    metric: str
    value: float
    bound: str
    ok: bool
    detail: dict = field(default_factory=dict)


def _make_runner(config, weights, dtype: str, budget: int):
    if _MODE["reference"]:
        from gpu_engine.reference.runner import ReferenceRunner

        return ReferenceRunner(config, weights)
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner

    return CudaRunner(config, weights, CudaOptions(dtype=dtype, memory_budget=budget))


def _close(runner) -> None:
    if hasattr(runner, "close"):
        runner.close()


def _require() -> None:
    from gpu_engine.cuda.device import require_gpu
    from gpu_engine.cuda.errors import CudaUnavailable

    require_gpu()
    try:
        import torch
        import transformers  # noqa: F401 - only checks that it is installed
    except ImportError as exc:
        raise CudaUnavailable(f"torch / transformers not installed: {exc}") from exc
    if not torch.cuda.is_available():
        raise CudaUnavailable("torch sees no CUDA device")


def gpu_ready() -> bool:
    """Whether the GPU, torch and transformers are there (`_require`); when not, False after printing why (the
    script then exits 0: skipped, not failed)."""
    from gpu_engine.cuda.errors import CudaUnavailable

    try:
        _require()
    except CudaUnavailable as exc:
        print(f"SKIP: {exc}")
        return False
    return True


# ------------------------------------------------------------------------------------------------ tiny, fp32


def _tiny_pair(folder: Path, seed: int):
    from gpu_engine.config import ModelConfig
    from gpu_engine.loader import load_weights
    from gpu_engine.model import LoadedModel

    hf, image_processor = build_hf_vlm_checkpoint("gqa2-half-rotary", folder, seed)
    hf = hf.to(_MODE["device"])
    ours_config = ModelConfig.from_pretrained(folder)
    weights, fingerprint = load_weights(folder, ours_config)
    runner = _make_runner(ours_config, weights, "f32", 2 << 30)
    ours = LoadedModel(config=ours_config, fingerprint=fingerprint, path=folder, runner=runner)
    return hf, image_processor, ours


def _hf_inputs(image_processor, ours, messages, images):
    prompt = ours.prepare(messages)
    inputs = hf_vlm_inputs(image_processor, prompt, ours.config, images)
    return prompt, {k: v.to(_MODE["device"]) for k, v in inputs.items()}


def _tiny_cases(rng: np.random.Generator):
    from PIL import Image

    image = Image.fromarray(rng.integers(0, 256, (45, 77, 3), dtype=np.uint8))
    frames = random_frames(rng, 16, 40, 56)
    return {
        "text": ([{"role": "user", "content": "Read the total of the invoice, please."}], []),
        "image": ([{"role": "user", "content": [{"type": "image", "image": image},
                                                {"type": "text", "text": "What is it?"}]}], [image]),
        "video (16 frames as a list)": ([{"role": "user", "content": [
            {"type": "video", "video": frames, "fps": 4.0}, {"type": "text", "text": "Describe the clip."}]}], []),
    }


def check_tiny(rng: np.random.Generator, seed: int) -> list[ParityResult]:
    import torch

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, image_processor, ours = _tiny_pair(Path(tmp), seed)
        try:
            for name, (messages, images) in _tiny_cases(rng).items():
                prompt, kwargs = _hf_inputs(image_processor, ours, messages, images)
                with torch.no_grad():
                    expected = hf(**kwargs).logits[0].float().cpu().numpy()
                for chunk in (None, 7):
                    got = ours.logits_for_messages(messages, chunk_size=chunk)
                    err = rel_err(got, expected)
                    label = "one chunk" if chunk is None else f"chunks of {chunk}"
                    results.append(ParityResult(f"tiny f32 {name}", f"logits rel-L2 ({label})", err,
                                                f"<= {LOGIT_TOL}", bool(err <= LOGIT_TOL),
                                                {"tokens": int(len(prompt))}))
                with torch.no_grad():
                    mask = torch.ones_like(kwargs["input_ids"])  # no token is padding (see _batched_decode)
                    out = hf.generate(**kwargs, attention_mask=mask, max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
                want = out[0, len(prompt):].tolist()
                got_tokens = ours.generate(messages, max_tokens=GREEDY_TOKENS, stop_token_ids=[])
                same = got_tokens == want
                results.append(ParityResult(f"tiny f32 {name}", f"{GREEDY_TOKENS} greedy tokens identical",
                                            float(same), "== 1", same, {"ours": got_tokens, "hf": want}))
            results += _batched_decode(hf, ours, rng)
        finally:
            _close(ours.runner)
    for r in results:
        print(f"{r.case:<40} {r.metric:<34} {r.value:.3g}  {'PASS' if r.ok else 'FAIL'}", flush=True)
    return results


def _batched_decode(hf, ours, rng: np.random.Generator, steps: int = 12) -> list[ParityResult]:
    """Two text prompts prefilled together, then decoded together; each vs transformers on its own."""
    import torch

    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    runner, vocab = ours.runner, ours.config.text.vocab_size
    block = 16
    runner.allocate_cache(CacheSpec(num_kv_blocks=16, block_size=block, num_state_slots=2))
    prompts = [rng.integers(0, vocab, 23), rng.integers(0, vocab, 31)]
    tables = [np.arange(0, 4, dtype=np.int32), np.arange(8, 12, dtype=np.int32)]

    def chunk(s: int, ids: np.ndarray, start: int) -> SeqChunk:
        pos = np.broadcast_to(np.arange(start, start + len(ids)), (3, len(ids))).astype(np.int64)
        return SeqChunk(s, ids, pos, start, tables[s], s, logits="last")

    out = runner.forward(StepBatch([chunk(s, p, 0) for s, p in enumerate(prompts)]))
    last = [out.logits[0], out.logits[1]]
    tokens: list[list[int]] = [[], []]
    step_logits: list[list[np.ndarray]] = [[], []]
    for _ in range(steps):
        for s in range(2):
            tokens[s].append(int(np.argmax(last[s])))
        batch = [chunk(s, np.array([tokens[s][-1]]), len(prompts[s]) + len(tokens[s]) - 1) for s in range(2)]
        logits = runner.forward(StepBatch(batch)).logits
        for s in range(2):
            step_logits[s].append(logits[s])
        last = [logits[0], logits[1]]
    results = []
    for s in range(2):
        ids = torch.from_numpy(prompts[s])[None].to(_MODE["device"])
        with torch.no_grad():
            # attention_mask given: generate() would otherwise infer one from pad_token_id and mask the prompt's
            # random token 0s as padding (seed 672541033 drew one; its first token then differed from forward()'s)
            want = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompts[s]):].tolist()
            full = torch.from_numpy(np.concatenate([prompts[s], tokens[s]]))[None].to(_MODE["device"])
            ref = hf(input_ids=full).logits[0].float().cpu().numpy()
        n = len(prompts[s])
        # decode step j saw token j at position n + j and predicts the next one: transformers' row n + j
        errs = [rel_err(step_logits[s][j], ref[n + j]) for j in range(steps)]
        worst = max(errs)
        results.append(ParityResult(f"tiny f32 batched decode seq {s}", f"{steps} greedy tokens identical",
                                    float(tokens[s] == want), "== 1", tokens[s] == want,
                                    {"ours": tokens[s], "hf": want}))
        results.append(ParityResult(f"tiny f32 batched decode seq {s}", "decode logits max rel-L2", worst,
                                    f"<= {LOGIT_TOL}", bool(worst <= LOGIT_TOL)))
    return results


# ------------------------------------------------------------------------------------------------ ~1B, bf16

BIG_TEXT = {
    "vocab_size": 248320, "hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 16,
    "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}
BIG_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
              "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 1536,
              "num_position_embeddings": 64}


def _randomize_on_device(model, seed: int) -> None:
    """O(1)-activation random values (the same scales as engine_hf_models.randomize), drawn on the GPU."""
    import torch

    dev = _MODE["device"]
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32)
            if name.endswith("A_log"):
                v = torch.rand(p.shape, generator=gen, device=dev).mul(1.95).add(0.05).log()
            elif name.endswith("dt_bias"):
                v = 1.0 + 0.3 * r
            elif name.endswith("linear_attn.norm.weight") or (".visual." in name and "norm" in name
                                                              and name.endswith("weight")):
                v = 1.0 + 0.2 * r
            elif "norm" in name and name.endswith("weight"):
                v = 0.2 * r
            elif name.endswith("bias"):
                v = 0.1 * r
            elif "embed_tokens" in name or "pos_embed" in name:
                v = r
            else:
                v = r / float(np.prod(p.shape[1:])) ** 0.5
            p.copy_(v)


def _weights_from_model(model, bits: bool = True):
    """ModelWeights straight from the transformers model: bf16 tensors as bf16 bit patterns (no float32 copy of
    the model; bits=False: float32), the fp32-uploaded DeltaNet decay parameters as float32."""
    import torch

    from gpu_engine.loader import ModelWeights

    text, vision, lm_head = {}, {}, None
    for name, t in model.state_dict().items():
        if name.endswith(("A_log", "dt_bias")) or not bits:
            arr = t.float().cpu().numpy()
        else:
            arr = t.to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().view(np.uint16)
        if name.startswith("model.language_model."):
            text[name.removeprefix("model.language_model.")] = arr
        elif name.startswith("model.visual."):
            vision[name.removeprefix("model.visual.")] = arr
        elif name == "lm_head.weight":
            lm_head = arr
    if model.config.tie_word_embeddings or lm_head is None:
        lm_head = text["embed_tokens.weight"]
    return ModelWeights(text=text, vision=vision, lm_head=lm_head)


def check_1b(rng: np.random.Generator, seed: int, positions: int = 256, prefill: int = 192,
             text: dict | None = None) -> list[ParityResult]:
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from gpu_engine.config import ModelConfig
    from gpu_engine.runner_api import CacheSpec, SeqChunk, StepBatch

    text = text or BIG_TEXT
    vision = {**BIG_VISION, "out_hidden_size": text["hidden_size"]}
    hf_config = Qwen3_5Config(text_config=dict(text), vision_config=vision, tie_word_embeddings=True)
    t0 = time.perf_counter()
    with torch.device(_MODE["device"]):
        hf = Qwen3_5ForConditionalGeneration(hf_config).to(torch.bfloat16).eval()
    _randomize_on_device(hf, seed)
    params = sum(p.numel() for p in hf.parameters())
    ids = rng.integers(0, text["vocab_size"], positions)
    dev = _MODE["device"]
    with torch.no_grad():
        hf_bf16 = hf(input_ids=torch.from_numpy(ids)[None].to(dev)).logits[0].float().cpu().numpy()
    weights = _weights_from_model(hf, bits=not _MODE["reference"])
    with tempfile.TemporaryDirectory() as tmp:  # our config parser reads config.json
        hf_config.save_pretrained(tmp)
        config = ModelConfig.from_pretrained(tmp)
    hf.float()  # in place: the float32 run for the noise floor
    with torch.no_grad():
        hf_f32 = hf(input_ids=torch.from_numpy(ids)[None].to(dev)).logits[0].float().cpu().numpy()
    del hf
    if dev == "cuda":
        torch.cuda.empty_cache()
    runner = _make_runner(config, weights, "bf16", 16 << 30)
    try:
        runner.allocate_cache(CacheSpec(num_kv_blocks=32, block_size=16, num_state_slots=1))
        table = np.arange(positions // 16 + 1, dtype=np.int32)

        def chunk(tok: np.ndarray, start: int, logits: str) -> StepBatch:
            pos = np.broadcast_to(np.arange(start, start + len(tok)), (3, len(tok))).astype(np.int64)
            return StepBatch([SeqChunk(0, tok, pos, start, table, 0, logits=logits)])

        rows = [runner.forward(chunk(ids[:prefill], 0, "all")).logits]
        for p in range(prefill, positions):  # teacher-forced decode: the same tokens transformers saw
            rows.append(runner.forward(chunk(ids[p:p + 1], p, "last")).logits)
        ours = np.concatenate(rows)
    finally:
        _close(runner)
    agree = float(np.mean(ours.argmax(-1) == hf_bf16.argmax(-1)))
    floor = float(np.mean(hf_bf16.argmax(-1) == hf_f32.argmax(-1)))
    vs_f32 = float(np.mean(ours.argmax(-1) == hf_f32.argmax(-1)))
    detail = {"params": int(params), "positions": positions, "prefill": prefill,
              "top1_hf_bf16_vs_hf_f32": floor, "top1_ours_vs_hf_f32": vs_f32,
              "logits_rel_l2_vs_hf_bf16": rel_err(ours, hf_bf16), "logits_rel_l2_vs_hf_f32": rel_err(ours, hf_f32),
              "hf_bf16_rel_l2_vs_hf_f32": rel_err(hf_bf16, hf_f32), "seconds": time.perf_counter() - t0}
    result = ParityResult(f"~{params / 1e9:.2f}B bf16 (prefill {prefill} + {positions - prefill} decode)",
                          "top-1 agreement vs transformers bf16", agree, f">= {TOP1_MIN}", agree >= TOP1_MIN, detail)
    print(f"{result.case:<40} {result.metric:<34} {agree:.4f}  {'PASS' if result.ok else 'FAIL'}  {detail}",
          flush=True)
    return [result]


def _guarded(case: str, run) -> list[ParityResult]:
    """Run one part; an exception becomes a failed result with its traceback (the other part still runs)."""
    import traceback

    try:
        return run()
    except Exception:  # noqa: BLE001 - reported as a failure, never swallowed
        text = traceback.format_exc()
        print(text, flush=True)
        return [ParityResult(case, "raised", float("nan"), "no exception", False, {"traceback": text[-3000:]})]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--cpu-harness", action="store_true", help="check this harness on the CPU (see docstring)")
    args = parser.parse_args(argv)
    if args.cpu_harness:
        _MODE.update(device="cpu", reference=True)
    elif not gpu_ready():
        return 0
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both sides
    torch.backends.cudnn.allow_tf32 = False  # (the patch embedding is a Conv3d)
    seed = fresh_seed(bits=31)
    rng = np.random.default_rng(seed)
    results = _guarded("tiny f32", lambda: check_tiny(rng, seed % 1000))
    if not args.skip_1b:
        small = {**BIG_TEXT, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                 "head_dim": 32, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4}
        results += _guarded("~1B bf16", lambda: check_1b(rng, seed, text=small if args.cpu_harness else None))
    print(f"seed {seed}: {sum(r.ok for r in results)}/{len(results)} passed")
    if args.json:
        info = {"seed": seed, "torch": torch.__version__, "mode": "cpu-harness" if args.cpu_harness else "gpu",
                "device": torch.cuda.get_device_name(0) if _MODE["device"] == "cuda" else "cpu"}
        import transformers

        info["transformers"] = transformers.__version__
        write_json(args.json, info, results)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
