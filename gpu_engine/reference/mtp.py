"""The checkpoint's multi-token-prediction head (Qwen3.5 `mtp.*`) in numpy float32, the drafter of speculative
decoding.

For the pair (h_p, x_{p+1}) at position p — h_p the target's final-norm hidden state (the output of its
forward, after `norm`, as vLLM's Qwen3.5 MTP feeds it) and x_{p+1} the token after position p:

    x = fc(concat(rms_norm(embed(x_{p+1}), pre_fc_norm_embedding), rms_norm(h_p, pre_fc_norm_hidden)))
    x = x + gated_full_attention(rms_norm(x, input_layernorm))       one decoder layer, its own KV
    x = x + mlp(rms_norm(x, post_attention_layernorm))             dense SwiGLU, or experts (MoE checkpoints)
    out = rms_norm(x, mtp.norm);  logits = lm_head(out)              a guess for x_{p+2}

All norms are zero-centred. Chaining: the next draft feeds (out, the draft) at position p + 1. A qwen3_5_moe head's
MLP is the trunk's mixture of experts (MoeMlp, either expert layout; names and shapes in gpu_engine/mtp_layout.py).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..config import TextConfig
from ..errors import RunnerInputError
from ..mtp_layout import MLP, held_layout_shapes, mtp_shapes
from .attention import attention_forward
from .moe import MoeMlp
from .ops import linear, mrope_cos_sin, rms_norm, swiglu


def has_complete_head(cfg: TextConfig, weights: Mapping[str, np.ndarray]) -> bool:
    """Whether `weights` (names relative to `mtp.`) hold every tensor of the head, in either expert layout."""
    return all(n in weights for n in held_layout_shapes(cfg, weights))


class MtpHead:
    def __init__(self, cfg: TextConfig, weights: Mapping[str, np.ndarray], embed: np.ndarray,
                 lm_head: np.ndarray) -> None:
        names = list(held_layout_shapes(cfg, weights))
        missing = [n for n in names if n not in weights]
        if missing:
            raise RunnerInputError(f"the checkpoint's MTP head lacks mtp.{', mtp.'.join(missing)}")
        self.cfg = cfg
        self.w = {n: np.asarray(weights[n], dtype=np.float32) for n in names}
        self.attn = {k[len("layers.0.self_attn."):]: a for k, a in self.w.items()
                     if k.startswith("layers.0.self_attn.")}
        mlp = {k[len(MLP):]: a for k, a in self.w.items() if k.startswith(MLP)}
        self.mlp: Callable[[np.ndarray], np.ndarray]  # [n, H] -> [n, H]: the trunk's kind of MLP
        if cfg.moe is not None:
            self.mlp = MoeMlp(cfg.moe, mlp)
        else:
            dense = (mlp["gate_proj.weight"], mlp["up_proj.weight"], mlp["down_proj.weight"])
            self.mlp = lambda x: swiglu(x, *dense)
        self.embed, self.lm_head = embed, lm_head

    def layer(self, next_embeds: np.ndarray, hidden: np.ndarray, positions: np.ndarray, k_cache: np.ndarray,
              v_cache: np.ndarray, block_table: np.ndarray, start: int) -> np.ndarray:
        """Pairs (hidden [n, H], the next tokens' input embeddings [n, H]) at positions start ... start + n - 1 ->
        mtp.norm outputs [n, H]; writes the head's keys / values of those positions into k_cache / v_cache."""
        cfg, w, eps = self.cfg, self.w, self.cfg.rms_norm_eps
        e = rms_norm(next_embeds, w["pre_fc_norm_embedding.weight"], eps)
        h = rms_norm(hidden, w["pre_fc_norm_hidden.weight"], eps)
        x = linear(np.concatenate([e, h], axis=-1), w["fc.weight"])
        cos, sin = mrope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
        a = rms_norm(x, w["layers.0.input_layernorm.weight"], eps)
        x = x + attention_forward(a, self.attn, cfg, cos, sin, k_cache, v_cache, block_table, start)
        x = x + self.mlp(rms_norm(x, w["layers.0.post_attention_layernorm.weight"], eps))
        return rms_norm(x, w["norm.weight"], eps)

    def logits(self, out: np.ndarray) -> np.ndarray:
        return linear(out, self.lm_head).astype(np.float32, copy=False)

    def draft(self, next_tokens: np.ndarray, hidden: np.ndarray, positions: np.ndarray, k_cache: np.ndarray,
              v_cache: np.ndarray, block_table: np.ndarray, start: int, num_drafts: int,
              next_embeds: np.ndarray | None = None) -> list[int]:
        """Fill the head's KV for positions [start, start + n) (the paged cache), then chain `num_drafts` greedy
        drafts. Chained positions lie past the sequence's blocks: they attend over a scratch copy of its blocks,
        and the paged cache is never written there (the real tokens of those positions overwrite it later).
        `next_embeds`: the next tokens' input embeddings where they are not the token table's (vision rows)."""
        n = next_tokens.shape[0]
        embeds = self.embed[next_tokens].astype(np.float32) if next_embeds is None else next_embeds
        out = self.layer(embeds, hidden, positions[:, :n], k_cache, v_cache, block_table, start)
        if num_drafts == 0:
            return []
        drafts = [int(np.argmax(self.logits(out[-1:])[0]))]
        if num_drafts == 1:
            return drafts
        bs = k_cache.shape[1]
        base = start + n  # first chained position
        held = -(-base // bs)
        total = -(-(base + num_drafts - 1) // bs)
        k_scratch = np.zeros((total,) + k_cache.shape[1:], np.float32)
        v_scratch = np.zeros_like(k_scratch)
        k_scratch[:held] = k_cache[block_table[:held]]
        v_scratch[:held] = v_cache[block_table[:held]]
        table = np.arange(total)
        h = out[-1:]
        for j in range(num_drafts - 1):
            pos = base + j
            e = self.embed[[drafts[-1]]].astype(np.float32)
            h = self.layer(e, h, positions[:, n + j:n + j + 1], k_scratch, v_scratch, table, pos)
            drafts.append(int(np.argmax(self.logits(h)[0])))
        return drafts


def random_mtp_weights(cfg: TextConfig, seed: int = 0, *, per_expert: bool = True) -> dict[str, np.ndarray]:
    """Deterministic random MTP weights (names relative to `mtp.`; a MoE head's experts in either layout), scaled
    like gpu_engine.tiny's: for tests of the mechanism on tiny checkpoints (gpu_engine/tiny_moe.py writes them)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in mtp_shapes(cfg, per_expert=per_expert).items():
        if "norm" in name:
            out[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)  # zero-centred: offset from 1
        else:  # by fan-in (the last axis: a fused expert tensor is one Linear per expert)
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    return out
