"""Engine.from_pretrained's work: load a checkpoint folder (gpu_engine.model.load) and build the Engine around it,
with the folder's tokenizer shared by the prompt processor and the model's own eos ids and context limit."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import model
from .cuda.options import CudaOptions
from .engine_config import EngineConfig
from .speculative import SpeculativeConfig
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .engine import Engine


def engine_from_pretrained(
    cls: type[Engine],
    folder: str | Path,
    runner: str,
    config: EngineConfig | None,
    *,
    expected_digests: dict[str, str] | None,
    cuda_options: CudaOptions | None,
    speculative: SpeculativeConfig | None,
    quantize: str | None,
    kv_cache_dtype: str = "auto",
) -> Engine:
    """`quantize`: None (the weights as stored) or "fp8" (a BF16 checkpoint's eligible Linears become 128x128-block
    FP8 at load; the fingerprint then names the recipe). model.load refuses anything else before a file is read.
    `kv_cache_dtype`: "auto" or "fp8_e4m3" (model.load); the runner's kv_bytes_per_block counts its bytes, so a
    kv_cache_bytes budget holds more blocks."""
    # model.load looked up at call time, so a test that replaces it for one test leaves no copy behind here
    loaded = model.load(folder, runner=runner, expected_digests=expected_digests, cuda_options=cuda_options,
                        quantize=quantize, kv_cache_dtype=kv_cache_dtype)
    tokenizer = Tokenizer.from_pretrained(folder)
    loaded.use_tokenizer(tokenizer)
    eos = list(loaded.config.eos_token_ids) if getattr(loaded.config, "eos_token_ids", None) else None
    return cls(
        loaded.runner,
        tokenizer,
        vocab_size=loaded.config.text.vocab_size,
        config=config,
        prepare=loaded.prepare,
        model_fingerprint=loaded.fingerprint,
        eos_token_ids=eos,
        model_max_len=loaded.config.text.max_position_embeddings,
        speculative=speculative,
    )
