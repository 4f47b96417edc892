"""The DeltaNet layer of CudaTextModel hands its prefill chunks to deltanet_chunked with the model's variant (set
by the runner from CudaOptions.deltanet_chunked), and its decode-only steps to the token-by-token kernel."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_engine.cuda import deltanet_chunked, ops
from gpu_engine.cuda.linear import DenseLinear
from gpu_engine.cuda.text_model import CudaTextModel, DeltaNetCache
from gpu_engine.cuda.weights import DeltaNetWeights
from tests.cuda_runner.test_decode_rows_apart import LaunchLog

KH, VH, DK, DV, KW, HIDDEN = 2, 4, 128, 128, 4, 64


def deltanet_call(monkeypatch, variant: str | None, longest_chunk: int) -> list[tuple[str, str | None]]:
    calls: list[tuple[str, str | None]] = []
    monkeypatch.setattr(deltanet_chunked, "chunked_gated_delta_rule",
                        lambda *a, variant=deltanet_chunked.DEFAULT_VARIANT: calls.append(("chunked", variant)))
    monkeypatch.setattr(ops, "gated_delta_rule", lambda *a: calls.append(("token", None)))
    conv_dim, vdim = 2 * KH * DK + VH * DV, VH * DV
    config = SimpleNamespace(linear_num_key_heads=KH, linear_num_value_heads=VH, linear_key_head_dim=DK,
                             linear_value_head_dim=DV, linear_conv_dim=conv_dim, linear_value_dim=vdim,
                             rms_norm_eps=1e-6, hidden_size=HIDDEN, rope_theta=1e7, rotary_dim=64,
                             mrope_section=[11, 11, 10])
    ctx = LaunchLog()
    model = CudaTextModel(ctx, config, weights=None, dtype="bf16")  # type: ignore[arg-type]  # weights unused here
    if variant is not None:
        model.deltanet_chunked = variant
    n = max(longest_chunk, 1)
    w = DeltaNetWeights(in_proj=DenseLinear(ctx.empty((conv_dim + vdim + 2 * VH, HIDDEN), "bf16", "win")),
                        conv=ctx.empty((conv_dim, KW), "bf16", "conv"), A_log=ctx.empty((VH,), "f32", "A"),
                        dt_bias=ctx.empty((VH,), "f32", "dt"), norm=ctx.empty((DV,), "bf16", "norm"),
                        out_proj=DenseLinear(ctx.empty((HIDDEN, vdim), "bf16", "wout")))
    m = SimpleNamespace(win=None, cu=ctx.empty((2,), "i32", "cu"), slots=ctx.empty((1,), "i32", "slots"),
                        fresh=ctx.empty((1,), "i32", "fresh"), tok_seq=ctx.empty((n,), "i32", "tok_seq"))
    a = SimpleNamespace(h=ctx.empty((n, HIDDEN), "bf16", "h"), d=ctx.empty((n, HIDDEN), "bf16", "d"))
    cache = DeltaNetCache(conv=ctx.empty((2, KW - 1, conv_dim), "bf16", "cc"), state=ctx.empty((2, VH, DV, DK), "f32",
                                                                                               "st"))
    model._deltanet(w, a, m, n, longest_chunk, cache)  # type: ignore[arg-type]  # stand-ins for the step tables
    return calls


def test_the_default_is_the_modules_default(monkeypatch) -> None:
    assert deltanet_call(monkeypatch, None, 4096) == [("chunked", deltanet_chunked.DEFAULT_VARIANT)]


@pytest.mark.parametrize("variant", deltanet_chunked.VARIANTS)
def test_prefill_chunks_take_the_models_variant(monkeypatch, variant) -> None:
    assert deltanet_call(monkeypatch, variant, 4096) == [("chunked", variant)]


def test_decode_steps_stay_on_the_token_kernel(monkeypatch) -> None:
    assert deltanet_call(monkeypatch, "states", 1) == [("token", None)]
