"""The Qwen3.5 language model on the GPU, layer for layer as reference/text_model.py: embeddings, decoder layers by
`layer_types`, final norm, lm head.

Each decoder layer: x += mixer(rms_norm(x)) with the mixer a Gated DeltaNet (linear_attention) or gated full
attention (full_attention); then x += MLP(rms_norm(x)), a SwiGLU or (qwen3_5_moe) a mixture of experts. On the
GPU every residual add is fused into the norm that follows it (add_rmsnorm: x += d; h = rms_norm(x)), so a block
leaves its output in `d` and the next norm adds it. All sequences of a step run together (varlen rows);
everything here only enqueues work on the context's stream, so a step can be captured in a CUDA graph. Every
projection is a linear layer (linear.py: `layer(ctx, y, x, rows)` computes y = x W^T whatever W's format, bf16 or
block-FP8).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import TextConfig
from . import deltanet_chunked, flash_plan, fp8_ops, ops, rotary, verify_ops
from .context import DArray, GpuContext
from .errors import ShapeError
from .fp8_ops import Fp8Activations
from .linear import SwigluMlp
from .moe_weights import set_moe_decode
from .options import CudaOptions
from .step import DeltaNetSplit, StepTables
from .weights import AttentionWeights, DeltaNetWeights, LayerWeights, TextWeights

FLASH_MIN_CHUNK = 32  # steps whose longest chunk has this many tokens use the tensor-core prefill attention


@dataclass
class AttentionCache:
    """A full-attention layer's share of the runner's cache: its paged keys and values."""

    k: DArray  # [blocks, block_size, kv_heads, head_dim]: the compute dtype, or u8 e4m3 bytes (FP8 cache, kv_fp8.py)
    v: DArray
    k_scale: DArray | None = None  # FP8 cache only: f32 [blocks, block_size, kv_heads], one scale per token and head
    v_scale: DArray | None = None


@dataclass
class DeltaNetCache:
    """A linear-attention layer's share of the runner's cache: per state slot, the conv window and the state."""

    conv: DArray  # [slots, K-1, conv_dim]
    state: DArray  # f32 [slots, Hv, dv, dk]
    # verify windows, window strategy (cuda/verify.py): the states after each window token, rows [windows * w, ...]
    window_conv: DArray | None = None
    window_state: DArray | None = None


@dataclass
class DeviceCache:
    block_size: int
    attention: dict[int, AttentionCache] = field(default_factory=dict)  # by layer index (full_attention layers)
    deltanet: dict[int, DeltaNetCache] = field(default_factory=dict)  # by layer index (linear_attention layers)


@dataclass
class Activations:
    """The step's residual stream and the two buffers the fused norms pass between blocks, [n, hidden] each."""

    x: DArray  # residual stream
    h: DArray  # normed input of the next block (after forward: the final-norm hidden states)
    d: DArray  # output of the last block, added to x by the next fused norm


class CudaTextModel:
    def __init__(self, ctx: GpuContext, config: TextConfig, weights: TextWeights, dtype: str) -> None:
        self.ctx, self.config, self.w, self.dtype = ctx, config, weights, dtype
        self.rope_inv = ctx.to_device(rotary.inv_freq(config.rope_theta, config.rotary_dim), "f32", "rope.inv_freq")
        self.rope_axis = ctx.to_device(rotary.mrope_axis(config.rotary_dim, config.mrope_section), "i32", "rope.axis")
        # In a step that carries a prompt chunk of FLASH_MIN_CHUNK+ tokens, give its one-token rows (decode tokens)
        # to paged_attention instead of one flash_prefill tile each (step.StepTables.dec_rows): on the H200 at
        # 192 x 8k that is 2.0 instead of 8.1 ms a layer. Set by the runner from CudaOptions.decode_rows_apart (on
        # by default since check_decode_rows_apart passed on an H200, session 8); off here for bare models.
        self.decode_rows_apart = False
        # The prefill attention kernel (flash_plan.flash_variant of CudaOptions.flash_prefill, set by the runner): every
        # step's tiles are built for it (build_step's tile_rows = flash_tile_rows).
        self.flash_variant = "fa2"
        # The chunked gated delta rule's variant for bf16 prefill (deltanet_chunked.VARIANTS, set by the runner).
        self.deltanet_chunked = deltanet_chunked.DEFAULT_VARIANT
        # In a step whose chunked delta rule would also take one-token rows, give a leading or trailing run of them
        # to the token kernel (step.StepTables.gdn_split; set by the runner from CudaOptions.deltanet_rows_apart):
        # each one-token row otherwise costs a 64-row chunk and a scan chain of its own.
        self.deltanet_rows_apart = False

    def use_options(self, o: CudaOptions, arch: str) -> None:
        """The kernel choices of CudaOptions (the runner calls this once, after building the model)."""
        self.decode_rows_apart = o.decode_rows_apart
        self.flash_variant = flash_plan.flash_variant(o.flash_prefill, self.config.head_dim,
                                                      o.kv_cache_dtype != "auto", arch)
        self.deltanet_chunked = o.deltanet_chunked
        self.deltanet_rows_apart = o.deltanet_rows_apart
        set_moe_decode(self.w.layers, o.moe_decode)  # the MoE layers' small-batch path (no-op for dense models)

    @property
    def flash_tile_rows(self) -> int:
        return flash_plan.FLASH_TILE_ROWS[self.flash_variant]

    def embed_tokens(self, x: DArray, ids: DArray) -> None:
        ops.embed_gather(self.ctx, x, self.w.embed, ids)

    def forward(self, a: Activations, t: StepTables[DArray], n: int, longest_chunk: int, cache: DeviceCache,
                keep_scratch: bool = False) -> None:
        """Embedded rows a.x of the step -> final-norm hidden states in a.h; updates the cache.

        Per-layer scratch is reused layer after layer (stream order makes that safe); keep_scratch=True gives
        every layer its own, so that a captured graph owns all the memory it touches."""
        ctx, cfg = self.ctx, self.config
        for i, layer in enumerate(self.w.layers):
            scratch = ctx.arena.mark()
            layer_cache = cache.attention[i] if isinstance(layer.mixer, AttentionWeights) else cache.deltanet[i]
            self.decoder_layer(layer, a, t, n, longest_chunk, layer_cache, cache.block_size, add=i > 0)
            if not keep_scratch:
                ctx.arena.release(scratch)
        ops.add_rmsnorm(ctx, a.h, a.x, a.d, self.w.final_norm, cfg.rms_norm_eps, True)

    def decoder_layer(self, layer: LayerWeights, a: Activations, t: StepTables[DArray], n: int, longest_chunk: int,
                      cache: AttentionCache | DeltaNetCache, block_size: int, add: bool) -> None:
        """One decoder layer on the step's rows: x (+= d first when `add`), mixer, MLP; its MLP output is left in
        a.d for the next fused norm to add. The MTP head (mtp.py) runs its one layer through this too."""
        mixer = layer.mixer
        first_proj = mixer.qkv if isinstance(mixer, AttentionWeights) else mixer.in_proj
        # x += previous MLP output (not before layer 0); h = rms_norm(x), quantised too when FP8 reads it
        hq = self._norm(a, layer.input_norm, n, first_proj.fp8_input, add=add)
        if isinstance(mixer, AttentionWeights) and isinstance(cache, AttentionCache):
            self._attention(mixer, a, t, n, longest_chunk, cache, block_size, hq)
        elif isinstance(mixer, DeltaNetWeights) and isinstance(cache, DeltaNetCache):
            self._deltanet(mixer, a, t, n, longest_chunk, cache, hq)
        else:
            raise ShapeError(f"a {layer.kind} layer was given a {type(cache).__name__}")
        # x += mixer output; h = rms_norm(x)
        hq = self._norm(a, layer.post_norm, n, isinstance(layer.mlp, SwigluMlp) and layer.mlp.fp8_input)
        self._mlp(layer, a, n, hq)

    def logits(self, out: DArray, rows: DArray, hidden: DArray, logit_rows: DArray, count: int) -> None:
        """float32 logits [count, vocab] into `out` of the hidden rows `logit_rows` (gathered into `rows`)."""
        ops.embed_gather(self.ctx, rows, hidden, logit_rows)  # row gather: the "table" is h, the ids are row numbers
        self.ctx.blas.linear(out.ptr, rows.ptr, self.w.lm_head.ptr, count, self.config.vocab_size,
                             self.config.hidden_size, dtype=self.dtype, y_dtype="f32")

    def _norm(self, a: Activations, w: DArray, n: int, fp8_next: bool, add: bool = True) -> Fp8Activations | None:
        """h = rms_norm(x) (add: x += d first). Where the next linear reads FP8 and can take the rows in one slice,
        the norm also writes h quantised (fp8_ops.norm_quant, one launch) and returns it for that linear."""
        ctx, cfg = self.ctx, self.config
        eps = cfg.rms_norm_eps
        if fp8_next and self.dtype == "bf16" and fp8_ops.fused_quant_ok(n):
            return fp8_ops.norm_quant(ctx, a.h, a.x, w, n, eps, True, residual=None) if not add else \
                fp8_ops.norm_quant(ctx, a.h, a.d, w, n, eps, True, residual=a.x)
        if add:
            ops.add_rmsnorm(ctx, a.h, a.x, a.d, w, eps, True)
        else:
            ops.rmsnorm(ctx, a.h, a.x, w, n, cfg.hidden_size, eps, True)
        return None

    def _mlp(self, layer: LayerWeights, a: Activations, n: int, hq: Fp8Activations | None = None) -> None:
        """d = MLP(h): SwiGLU with gate and up as one GEMM (linear.SwigluMlp), or routed + shared experts
        (moe.MoeLayer). hq: h quantised by the norm (SwiGLU with FP8 gate|up only)."""
        if isinstance(layer.mlp, SwigluMlp):
            layer.mlp(self.ctx, a.d, a.h, n, hq)
        else:
            layer.mlp(self.ctx, a.d, a.h, n)

    def _attention(self, w: AttentionWeights, a: Activations, m: StepTables[DArray], n: int, longest_chunk: int,
                   cache: AttentionCache, block_size: int, hq: Fp8Activations | None = None) -> None:
        """Gated full attention over the paged KV cache: d = o_proj(attention(q, k, v) * sigmoid(gate))."""
        ctx, cfg, t = self.ctx, self.config, self.dtype
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = (2 * nh + 2 * kvh) * hd
        proj = ctx.empty((n, width), t, "qkv")
        w.qkv(ctx, proj, a.h, n, xq=hq)
        q = ctx.empty((n, nh * hd), t, "q")
        ops.qk_norm_rope_store(ctx, q, cache.k, cache.v, proj, width, w.q_norm, w.k_norm, m.pos, self.rope_inv,
                               self.rope_axis, m.kv_slots, nh, kvh, hd, cfg.rotary_dim, cfg.rms_norm_eps,
                               k_scale=cache.k_scale, v_scale=cache.v_scale)
        out = ctx.empty((n, nh * hd), t, "attn")
        args = (out, q, nh * hd, proj.at(hd), width, 2 * hd, cache.k, cache.v, m.tables, m.tok_seq, m.tok_pos)
        ks, vs = cache.k_scale, cache.v_scale  # FP8 cache only (kv_fp8.py)
        rows, seqs, pos, tiles_apart = m.dec_rows, m.dec_seq, m.dec_pos, m.tiles_apart
        if t == "bf16" and hd in flash_plan.FLASH_HEAD_DIMS and longest_chunk >= FLASH_MIN_CHUNK:
            variant = self.flash_variant
            if self.decode_rows_apart and rows is not None and seqs is not None and pos is not None \
                    and tiles_apart is not None:
                ops.flash_prefill(ctx, *args, tiles_apart, nh, kvh, hd, block_size, hd ** -0.5, k_scale=ks,
                                  v_scale=vs, variant=variant)
                self._decode_rows(out, q, proj, cache, m.tables, rows, seqs, pos, block_size)
            else:
                ops.flash_prefill(ctx, *args, m.tiles, nh, kvh, hd, block_size, hd ** -0.5, k_scale=ks, v_scale=vs,
                                  variant=variant)
        else:  # decode steps, short chunks, fp32 runs
            ops.paged_attention(ctx, *args, nh, kvh, hd, block_size, hd ** -0.5, k_scale=ks, v_scale=vs)
        w.o_proj(ctx, a.d, out, n)

    def _decode_rows(self, out: DArray, q: DArray, proj: DArray, cache: AttentionCache, tables: DArray,
                     rows: DArray, seqs: DArray, pos: DArray, block_size: int) -> None:
        """Attention of a mixed step's decode rows: their q and q|gate rows gathered, paged_attention over them
        (each K/V row read once for the query heads sharing it), the output rows scattered back into `out`."""
        ctx, cfg, t = self.ctx, self.config, self.dtype
        nh, kvh, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width, d = proj.shape[1], rows.size
        qd = ctx.empty((d, nh * hd), t, "q-decode-rows")
        ops.embed_gather(ctx, qd, q, rows)
        pd = ctx.empty((d, width), t, "qkv-decode-rows")
        ops.embed_gather(ctx, pd, proj, rows)
        od = ctx.empty((d, nh * hd), t, "attn-decode-rows")
        ops.paged_attention(ctx, od, qd, nh * hd, pd.at(hd), width, 2 * hd, cache.k, cache.v, tables, seqs, pos, nh,
                            kvh, hd, block_size, hd ** -0.5, k_scale=cache.k_scale,
                            v_scale=cache.v_scale)
        ops.scatter_rows(ctx, out, od, rows)

    def _deltanet(self, w: DeltaNetWeights, a: Activations, m: StepTables[DArray], n: int, longest_chunk: int,
                  cache: DeltaNetCache, hq: Fp8Activations | None = None) -> None:
        """Gated DeltaNet: causal conv + SiLU, the gated delta rule over the slot's state, gated RMSNorm, out_proj."""
        ctx, cfg, t = self.ctx, self.config, self.dtype
        kh, vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim, vdim = cfg.linear_conv_dim, cfg.linear_value_dim
        width = conv_dim + vdim + 2 * vh
        proj = ctx.empty((n, width), t, "in_proj")
        w.in_proj(ctx, proj, a.h, n, xq=hq)
        conv_out = ctx.empty((n, conv_dim), t, "conv_out")
        windows = verify_ops.window_rows(m.win, cache.window_conv, cache.window_state)
        if windows is not None:  # a verify step keeping every window token's state (the decode kernels' window form)
            verify_ops.conv1d_silu_window(ctx, conv_out, conv_dim, proj, width, w.conv, cache.conv, windows.conv,
                                          windows.base, m.cu, m.slots, m.fresh)
        else:
            ops.conv1d_silu(ctx, conv_out, conv_dim, proj, width, w.conv, cache.conv, m.cu, m.slots, m.fresh,
                            token_seq=m.tok_seq)
        core = ctx.empty((n, vdim), t, "core")
        gdn_args = (ctx, core, conv_out, conv_out.at(kh * dk), conv_out.at(2 * kh * dk), conv_dim,
                    proj.at(conv_dim + vdim + vh), proj.at(conv_dim + vdim), width, w.A_log, w.dt_bias,
                    cache.state, m.cu, m.slots, m.fresh, kh, vh, dk, dv)
        if windows is not None:
            verify_ops.gated_delta_rule_window(*gdn_args, window=windows.state, win_base=windows.base)
        elif (t == "bf16" and longest_chunk >= deltanet_chunked.MIN_PREFILL_TOKENS
                and deltanet_chunked.supports(dk, dv)):  # prefill: chunked WY form on the tensor cores
            split = m.gdn_split if self.deltanet_rows_apart else None
            if split is None:
                deltanet_chunked.chunked_gated_delta_rule(*gdn_args, variant=self.deltanet_chunked)
            else:
                self._delta_rule_apart(w, core, conv_out, proj, cache, m, split)
        else:  # decode steps, short chunks, fp32 runs: the exact token-by-token kernels
            ops.gated_delta_rule(*gdn_args)
        normed = ctx.empty((n * vh, dv), t, "gated_norm")
        ops.rmsnorm_gated(ctx, normed, core.view((n * vh, dv)), proj.at(conv_dim), w.norm, cfg.rms_norm_eps, vh, width)
        w.out_proj(ctx, a.d, normed, n)

    def _delta_rule_apart(self, w: DeltaNetWeights, core: DArray, conv_out: DArray, proj: DArray,
                          cache: DeltaNetCache, m: StepTables[DArray], split: DeltaNetSplit) -> None:
        """The gated delta rule of a mixed step in two launches over disjoint rows and state slots: the chunk
        block on the chunked kernel, the run of one-token rows on the token kernel (what a decode step of those
        rows runs). Each sees its block as a whole step: row pointers at the block's first row, its own tables."""
        cfg = self.config
        kh, vh, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
            cfg.linear_value_head_dim
        conv_dim, vdim = cfg.linear_conv_dim, cfg.linear_value_dim
        width = proj.shape[1]
        if m.gdn_cu is None or m.gdn_slots is None or m.gdn_fresh is None or m.gdn_tok_cu is None \
                or m.gdn_tok_slots is None or m.gdn_tok_fresh is None:
            raise ShapeError("a step with a DeltaNet split lacks its gdn_* tables")

        def on_rows(rule: Callable[..., None], row: int, rows: int, cu: DArray, slots: DArray, fresh: DArray,
                    **options: str) -> None:
            qkv, ab = conv_out.at(row * conv_dim), proj.at(row * width)
            rule(self.ctx, core.view((rows, vdim), row * vdim), qkv, qkv.at(kh * dk), qkv.at(2 * kh * dk), conv_dim,
                 ab.at(conv_dim + vdim + vh), ab.at(conv_dim + vdim), width, w.A_log, w.dt_bias, cache.state, cu,
                 slots, fresh, kh, vh, dk, dv, **options)

        on_rows(deltanet_chunked.chunked_gated_delta_rule, split.chunk_row, split.chunk_rows, m.gdn_cu, m.gdn_slots,
                m.gdn_fresh, variant=self.deltanet_chunked)
        on_rows(ops.gated_delta_rule, split.token_row, split.token_rows, m.gdn_tok_cu, m.gdn_tok_slots,
                m.gdn_tok_fresh)
