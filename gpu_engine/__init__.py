"""docpipe's inference engine for Qwen3.5-family vision-language models.

Public surface (names resolve lazily so that importing the package stays cheap):
    gpu_engine.load(path, runner="reference") -> LoadedModel   # .logits / .logits_for_messages / .generate
    gpu_engine.Engine, AsyncEngine, EngineConfig                 # continuous-batching engine
    gpu_engine.SamplingParams, RequestOutput, TokenLogprob       # request / response types
    gpu_engine.ModelConfig                                       # parsed config.json
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load": "model",
    "LoadedModel": "model",
    "ModelConfig": "config",
    "Engine": "engine",
    "AsyncEngine": "async_engine",
    "EngineConfig": "engine_config",
    "SamplingParams": "params",
    "RequestOutput": "params",
    "TokenLogprob": "params",
}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
