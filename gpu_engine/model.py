"""The engine's small public surface for scripts, benchmarks and checks: load a checkpoint, get logits, generate.

    import gpu_engine
    m = gpu_engine.load("path/to/checkpoint", runner="reference")    # or runner="cuda"
    m.logits(input_ids)                 # float32 [T, vocab], text-only token ids
    m.logits_for_messages(messages)     # chat template + processor applied, images / videos encoded
    m.generate(messages_or_ids, max_tokens=24, temperature=0.0) -> list[int]

One sequence at a time, through the same runner contract the continuous-batching engine uses (a single state
slot and a block table covering the whole sequence). For serving many requests use gpu_engine.Engine.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .cuda.options import CudaOptions
from .encoder_cache import check_embeddings, chunk_slices
from .errors import EngineError
from .inputs import ProcessedPrompt, VisionItem, is_token_ids
from .loader import ModelWeights, check_quantize, load_weights
from .reference.fp8_kv import check_kv_cache_dtype
from .rope_index import text_positions
from .runner_api import CacheSpec, LogitsWanted, Runner, SeqChunk, StepBatch, VisionSlice

RUNNERS = ("reference", "cuda")
_BLOCK_SIZE = 16


class RunnerUnavailableError(EngineError, RuntimeError):
    """The requested runner cannot run here (e.g. runner='cuda' without the CUDA packages or a GPU)."""


def load(
    path: str | Path,
    runner: str = "reference",
    *,
    expected_digests: dict[str, str] | None = None,
    cuda_options: CudaOptions | None = None,
    quantize: str | None = None,
    fp8_activations: bool = False,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """Load a checkpoint folder: config, verified weights (SHA256SUMS / expected_digests), fingerprint, runner.
    `cuda_options`: settings of the cuda runner; None reads them from the DOCPIPE_CUDA_* variables
    (CudaOptions.from_env). `quantize="fp8"`: a BF16 checkpoint's eligible Linears become 128x128-block FP8 at load
    (gpu_engine/fp8_checkpoint.py); `fp8_activations`: the reference runner also quantises those Linears' inputs
    as the FP8 kernels do. The cuda runner runs FP8 models with dtype "bf16" only (its FP8 GEMMs read and write
    bf16), and MoE models (qwen3_5_moe) from BF16 weights only (no FP8 expert stacks yet, issue 17).
    `kv_cache_dtype`: "auto" (the compute dtype) or "fp8_e4m3" (the reference runner stores full-attention K / V in
    e4m3 with a scale per token and kv head, reference/fp8_kv.py); independent of the weights. On the cuda runner
    it sets CudaOptions.kv_cache_dtype (same layout and rule, cuda/kv_fp8.py; opt-in: default "auto")."""
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}; choose one of {', '.join(RUNNERS)}")
    if cuda_options is not None and runner != "cuda":
        raise ValueError(f"cuda_options are for runner='cuda' (got runner={runner!r})")
    if fp8_activations and runner != "reference":
        raise ValueError(f"fp8_activations is an option of runner='reference' (got runner={runner!r})")
    check_quantize(quantize)
    check_kv_cache_dtype(kv_cache_dtype)
    folder = Path(path)
    config = ModelConfig.from_pretrained(folder)
    if runner == "cuda" and config.text.moe is not None and (config.quantization is not None or quantize == "fp8"):
        what = "an FP8 checkpoint" if config.quantization is not None else "quantize='fp8'"
        raise RunnerUnavailableError(
            f"runner='cuda' runs model_type={config.model_type!r} (a mixture of experts) from BF16 weights only, not "
            f"{what}: its grouped expert GEMMs have no FP8 path yet (issue 17). Load the BF16 release without "
            "quantize, or use runner='reference' (numpy, exact dequantisation)."
        )
    if runner == "cuda" and (config.quantization is not None or quantize == "fp8"):
        dtype = (cuda_options or CudaOptions.from_env()).dtype
        if dtype != "bf16":
            what = "an FP8 checkpoint" if config.quantization is not None else "quantize='fp8'"
            raise RunnerUnavailableError(
                f"runner='cuda' runs {what} with dtype='bf16' only (its FP8 GEMMs read and write bf16), not "
                f"dtype={dtype!r}. Use dtype='bf16', or runner='reference' (numpy, exact dequantisation)."
            )
    weights, fingerprint = load_weights(folder, config, expected_digests=expected_digests, quantize=quantize)
    return LoadedModel(config=config, fingerprint=fingerprint, path=folder,
                       runner=_make_runner(runner, config, weights, cuda_options, fp8_activations, kv_cache_dtype))


def _make_runner(
    name: str, config: ModelConfig, weights: ModelWeights, options: CudaOptions | None, fp8_activations: bool,
    kv_cache_dtype: str,
) -> Runner:
    if name == "reference":
        from .reference.runner import ReferenceRunner

        return ReferenceRunner(config, weights, fp8_activations=fp8_activations, kv_cache_dtype=kv_cache_dtype)
    try:
        from .cuda.runner import CudaRunner
    except ImportError as exc:
        raise RunnerUnavailableError(
            f"runner='cuda' is unavailable: {exc}. Install the extra (pip install -e '.[cuda]') on a machine with an "
            "NVIDIA GPU, or use runner='reference'."
        ) from exc
    options = options or CudaOptions.from_env()
    if kv_cache_dtype != "auto":  # the argument names a cache dtype: it wins over the options' default
        options = replace(options, kv_cache_dtype=kv_cache_dtype)
    return CudaRunner(config, weights, options)


@dataclass
class LoadedModel:
    config: ModelConfig
    fingerprint: str  # sha256 over config.json + weight files, + the recipe if quantised at load (loader)
    path: Path
    runner: Runner
    _capacity_tokens: int = field(default=0, repr=False)
    _processor: Any = field(default=None, repr=False)
    _tokenizer: Any = field(default=None, repr=False)  # set by use_tokenizer(): shared with the processor

    def use_tokenizer(self, tokenizer: Any) -> None:
        """Share a tokenizer the caller already loaded from this folder with the prompt processor."""
        self._tokenizer = tokenizer

    # ------------------------------------------------------------------------------------------------ prompts

    def text_prompt(self, input_ids: Sequence[int] | np.ndarray) -> ProcessedPrompt:
        """A text-only prompt: all three M-RoPE position rows are 0..T-1."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("input_ids is empty")
        positions = text_positions(ids.size)
        return ProcessedPrompt(token_ids=ids, positions=positions, rope_delta=0, vision_items=[])

    def prepare(
        self,
        messages: list[dict[str, Any]] | Sequence[int] | np.ndarray,
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
    ) -> ProcessedPrompt:
        """Chat template + processor (tokens, M-RoPE positions, vision items) for an OpenAI-style message list
        (token ids are taken as a finished text-only prompt). Needs the folder's tokenizer and processor files."""
        if self._processor is None:
            from .processor import Processor

            self._processor = Processor.from_pretrained(self.path, self.config, tokenizer=self._tokenizer)
        return self._processor.prepare(
            messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
        )

    # ------------------------------------------------------------------------------------------------ logits

    def logits(self, input_ids: Sequence[int] | np.ndarray, *, chunk_size: int | None = None) -> np.ndarray:
        """float32 [T, vocab]: logits at every position of a text-only prompt."""
        return self.prefill(self.text_prompt(input_ids), chunk_size=chunk_size)

    def logits_for_messages(self, messages: list[dict[str, Any]], *, chunk_size: int | None = None) -> np.ndarray:
        """float32 [T, vocab] for the expanded prompt of `messages` (generation prompt appended)."""
        return self.prefill(self.prepare(messages), chunk_size=chunk_size)

    def prefill(self, prompt: ProcessedPrompt, *, chunk_size: int | None = None,
                logits: LogitsWanted = "all") -> np.ndarray:
        """Run a fresh sequence's prompt in chunks of `chunk_size` tokens (None: one chunk); returns logit rows."""
        total = len(prompt)
        step = total if chunk_size is None else chunk_size
        if step < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self._ensure_cache(total)
        embeddings: dict[str, Any] = {}  # content hash -> runner-native embeddings, encoded when first needed
        rows = []
        for begin in range(0, total, step):
            end = min(begin + step, total)
            want = logits if logits == "all" else ("last" if end == total and logits == "last" else "none")
            vision = self._vision_slices(prompt.vision_items, begin, end, embeddings)
            out = self._step(prompt.token_ids[begin:end], prompt.positions[:, begin:end], begin, want, vision)
            rows.append(out)
        return np.concatenate(rows, axis=0)

    # ------------------------------------------------------------------------------------------------ generation

    def generate(
        self,
        messages_or_ids: list[dict[str, Any]] | Sequence[int] | np.ndarray,
        max_tokens: int = 24,
        temperature: float = 0.0,
        *,
        seed: int | None = None,
        chunk_size: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[int]:
        """Generated token ids (greedy when temperature == 0). Stops after an eos / stop token (included)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if is_token_ids(messages_or_ids):
            prompt = self.text_prompt(messages_or_ids)
        else:
            prompt = self.prepare(messages_or_ids)
        stops = set(self.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
        rng = np.random.default_rng(seed)
        total = len(prompt) + max_tokens
        self._ensure_cache(total)
        last = self.prefill(prompt, chunk_size=chunk_size, logits="last")[-1]
        out: list[int] = []
        while True:
            token = _pick(last, temperature, rng)
            out.append(token)
            if token in stops or len(out) == max_tokens:
                return out
            index = len(prompt) + len(out) - 1  # where the new token sits in the sequence
            positions = np.full((3, 1), index + prompt.rope_delta, dtype=np.int64)
            last = self._step(np.array([token], dtype=np.int64), positions, index, "last", [])[-1]

    # ------------------------------------------------------------------------------------------------ internals

    def _ensure_cache(self, tokens: int) -> None:
        """(Re)allocate a one-sequence cache holding `tokens`, growing by powers of two."""
        if tokens <= self._capacity_tokens:
            return
        blocks = 1 << max(4, math.ceil(math.log2(math.ceil(tokens / _BLOCK_SIZE))))
        self.runner.allocate_cache(CacheSpec(num_kv_blocks=blocks, block_size=_BLOCK_SIZE, num_state_slots=1))
        self._capacity_tokens = blocks * _BLOCK_SIZE

    def _step(
        self, token_ids: np.ndarray, positions: np.ndarray, start: int, logits: LogitsWanted,
        vision: list[VisionSlice],
    ) -> np.ndarray:
        n = token_ids.shape[0]
        table = np.arange(math.ceil((start + n) / _BLOCK_SIZE), dtype=np.int32)
        chunk = SeqChunk(
            seq_id=0, token_ids=token_ids, positions=positions, start=start, block_table=table,
            state_slot=0, vision=vision, logits=logits,
        )
        return self.runner.forward(StepBatch(chunks=[chunk])).logits

    def _vision_slices(
        self, items: list[VisionItem], begin: int, end: int, cache: dict[str, Any]
    ) -> list[VisionSlice]:
        """Embeddings of the vision items overlapping chunk [begin, end), encoding each item when first touched.

        The runner's own embeddings object is passed through (VisionSlice.embeddings is runner-native): a GPU
        runner's stay on the device, where converting them with np.asarray would copy them to the host and back."""

        def embeddings(item: VisionItem) -> Any:
            if item.content_hash not in cache:
                emb = self.runner.encode_vision(item)
                check_embeddings(item, emb)
                cache[item.content_hash] = emb
            return cache[item.content_hash]

        return chunk_slices(items, begin, end, embeddings)


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(p.size, p=p / p.sum()))
