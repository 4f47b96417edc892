"""The memory plan's step reserve (memory_plan.step_reserve_bytes) holds what a Gated DeltaNet layer really takes from
the arena: CudaTextModel._deltanet run on a recording context at the 9B and 35B-A3B shapes, 8192 tokens, with one
prompt chunk and up to 255 one-token rows (each a chunk slot of the chunked delta rule's workspace), in either
chunked variant. The arena's high-water mark is measured, not recomputed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_engine.config import ModelConfig, TextConfig
from gpu_engine.cuda import deltanet_chunked, memory_plan
from gpu_engine.cuda.arena import ALIGN, Arena
from gpu_engine.cuda.context import DArray, GpuContext
from gpu_engine.cuda.linear import DenseLinear
from gpu_engine.cuda.text_model import Activations, CudaTextModel, DeltaNetCache
from gpu_engine.cuda.weights import DeltaNetWeights

TOKENS, KW = 8192, 4
MOE_35B_A3B = {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
               "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
               "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
               "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512}
SHAPES = {"9b": ("qwen3_5", {}), "35b-a3b": ("qwen3_5_moe", MOE_35B_A3B)}  # {}: transformers' default is 9B


def text_config(name: str) -> TextConfig:
    model_type, text = SHAPES[name]
    return ModelConfig.from_dict({"model_type": model_type, "text_config": text, "vision_config": {}}).text


class Recording(GpuContext):
    """A GpuContext over a fake address space: real arena arithmetic, launches and GEMMs dropped."""

    def __init__(self) -> None:  # no device: nothing is launched or uploaded
        self.arena = Arena(base=1 << 40, capacity=1 << 40)
        self.device = SimpleNamespace(  # type: ignore[assignment]  # what the launchers call
            launch=lambda *a, **k: None, info=SimpleNamespace(sm_count=132), upload=lambda *a: None)
        self.blas = SimpleNamespace(linear=lambda *a, **k: None)  # type: ignore[assignment]  # the linears' call


def deltanet_layer_peak(cfg: TextConfig, seqs: int, variant: str) -> int:
    """Arena high-water mark of one DeltaNet layer's step (residual stream included, step tables not)."""
    ctx = Recording()
    model = CudaTextModel(ctx, cfg, weights=None, dtype="bf16")  # type: ignore[arg-type]  # weights: w below
    model.deltanet_chunked = variant
    H, vh, conv_dim, vdim = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_conv_dim, cfg.linear_value_dim
    w = DeltaNetWeights(in_proj=DenseLinear(DArray(1, (conv_dim + vdim + 2 * vh, H), "bf16")),
                        conv=DArray(1, (conv_dim, KW), "bf16"), A_log=DArray(1, (vh,), "f32"),
                        dt_bias=DArray(1, (vh,), "f32"), norm=DArray(1, (cfg.linear_value_head_dim,), "bf16"),
                        out_proj=DenseLinear(DArray(1, (H, vdim), "bf16")))
    cache = DeltaNetCache(conv=DArray(1, (seqs, KW - 1, conv_dim), "bf16"),
                          state=DArray(1, (seqs, vh, cfg.linear_value_head_dim, cfg.linear_key_head_dim), "f32"))
    i32 = lambda size, name: ctx.empty((size,), "i32", name)  # noqa: E731
    m = SimpleNamespace(win=None, cu=i32(seqs + 1, "cu"), slots=i32(seqs, "slots"), fresh=i32(seqs, "fresh"),
                        tok_seq=i32(TOKENS, "tok_seq"), gdn_split=None)
    base = ctx.arena.peak  # the step tables are the plan's margin (MARGIN_BYTES)
    a = Activations(x=ctx.empty((TOKENS, H), "bf16", "x"), h=ctx.empty((TOKENS, H), "bf16", "h"),
                    d=ctx.empty((TOKENS, H), "bf16", "d"))
    model._deltanet(w, a, m, TOKENS, TOKENS - seqs + 1, cache)  # type: ignore[arg-type]  # m: the tables it reads
    return ctx.arena.peak - base


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("seqs", [1, 64, 256])
@pytest.mark.parametrize("variant", deltanet_chunked.VARIANTS)
def test_step_reserve_holds_a_deltanet_layers_arena_peak(name: str, seqs: int, variant: str) -> None:
    cfg = text_config(name)
    peak = deltanet_layer_peak(cfg, seqs, variant)
    assert peak <= memory_plan.deltanet_step_bytes(cfg, TOKENS, seqs, 2) + 16 * ALIGN  # alignment: the margin's
    # the reserve asked for max_num_seqs = seqs keeps it, the logits rows besides
    logits = seqs * cfg.vocab_size * 4 * memory_plan.LOGIT_ROW_COPIES
    assert peak + logits <= memory_plan.step_reserve_bytes(cfg, TOKENS, seqs, 2)


def test_the_35b_a3b_deltanet_layer_outgrows_the_per_token_factor() -> None:
    # why deltanet_step_bytes exists: at 2048 hidden and no dense MLP, twelve values of hidden a token cover less
    # than the states variant's workspace at 256 sequences, even with the 1 GiB margin on top
    cfg = text_config("35b-a3b")
    factor = TOKENS * (memory_plan.STEP_BYTES_PER_TOKEN_FACTOR * cfg.hidden_size * 2
                       + memory_plan.scratch_bytes_per_token(cfg, 2))
    assert deltanet_layer_peak(cfg, 256, "states") > factor + memory_plan.MARGIN_BYTES
    assert memory_plan.deltanet_step_bytes(text_config("9b"), TOKENS, 64, 2) < TOKENS * (
        memory_plan.STEP_BYTES_PER_TOKEN_FACTOR * 12288 * 2)  # the dense 9B keeps its factor reserve
