"""The numpy reference with bf16-rounded activations: how far bf16 rounding alone moves a model's logits.

`bf16_activations(runner)` rounds, for as long as the context lasts, every normed block input, every mixer output
and every MLP output of `runner` (a ReferenceRunner) to bf16, as the bf16 CUDA runner stores them (it rounds more
places still: every projection's output). A mixture of experts is discontinuous in its input: a near-tie top-k
choice can flip under that rounding and move a token's whole MLP output, so tiny random MoE models move by
0.02-0.3 in logits rel. err. with bf16 activations (bench/results/cuda_notes.md, 2026-12-02), above check_runner's
fixed 0.1 bf16 sanity bound; check_moe scales its bf16 bound by what this emulation measures on the same draw.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import gpu_engine.reference.text_model as text_model
from gpu_engine.cuda.bf16 import round_to_bf16

_ROUNDED = ("rms_norm", "deltanet_forward", "attention_forward")  # looked up in text_model at call time


def _rounding(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def wrapped(*args: Any, **kwargs: Any) -> np.ndarray:
        return round_to_bf16(np.asarray(fn(*args, **kwargs), np.float32))

    return wrapped


@contextmanager
def bf16_activations(runner: Any) -> Iterator[Any]:
    saved = {name: getattr(text_model, name) for name in _ROUNDED}
    mlps = list(runner.text.mlps)
    try:
        for name, fn in saved.items():
            setattr(text_model, name, _rounding(fn))
        runner.text.mlps[:] = [_rounding(m) for m in mlps]
        yield runner
    finally:
        for name, fn in saved.items():
            setattr(text_model, name, fn)
        runner.text.mlps[:] = mlps
