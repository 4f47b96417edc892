"""ReferenceRunner: the numpy float32 implementation of the runner contract (gpu_engine/runner_api.py).

Cache layout (allocated once by `allocate_cache`):
- per full-attention layer: k and v arrays [num_kv_blocks, block_size, num_key_value_heads, head_dim] (float32, or
  e4m3 bytes + a scale per token and head with kv_cache_dtype="fp8_e4m3": reference/fp8_kv.py);
- per linear-attention layer: conv state [num_state_slots, conv_dim, conv_kernel - 1] and recurrent state
  [num_state_slots, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim].

Sequences of a step are run one after another: this runner is the oracle, so it stays plain.

Speculative decoding (runner_api.py): a verify window runs one token at a time, exactly as decode steps would (its
hidden states equal theirs bit for bit; the lm_head product over its rows rounds like any batch of decode rows),
keeping the linear-attention state after each token for rollback_state(). A checkpoint with an MTP head (`mtp.*`)
gets one more KV layer per block for it (mtp_draft()).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import RunnerInputError
from ..inputs import VisionItem
from ..loader import ModelWeights
from ..runner_api import (
    CacheSpec,
    MtpDraftRequest,
    SamplingRequest,
    SeqChunk,
    StepBatch,
    StepOutput,
    fed_chunks,
    sample_on_host,
)
from ..runner_rules import (
    allocated,
    check_cache_spec,
    check_chunk,
    check_state_slots,
    kv_bytes_per_block,
    row_offsets,
    state_bytes_per_slot,
)
from ..sampling import SampleResult
from ..vision_batch import row_ranges, stacked
from .fp8_kv import SCALE_BYTES, KvArray, check_kv_cache_dtype, kv_array
from .mtp import MtpHead, has_complete_head
from .text_model import SequenceCache, TextModel

_F32 = 4  # bytes

class ReferenceRunner:
    name = "reference"
    # The runner contract's sampling capability, carried out by the numpy sampler (runner_api.sample_on_host).
    # Off by default: the engine then samples the returned logits itself, which is the same code; tests switch it
    # on to drive the engine's runner-sampling path.
    samples_on_device = False
    supports_verify = True  # SeqChunk.verify + rollback_state()
    # launch() / finish() (runner_api.py, lookahead.py); off like samples_on_device (nothing to overlap in numpy):
    # tests switch both on to drive the engine's lookahead path
    supports_lookahead = False
    batches_vision = True  # encode_vision_batch: same-grid items in one tower call
    _launched: np.ndarray | None = None  # the launched step's logits rows, until they are sampled

    def __init__(self, model_config: ModelConfig, weights: ModelWeights, *, fp8_activations: bool = False,
                 kv_cache_dtype: str = "auto") -> None:
        """fp8_activations: emulate the dynamic FP8 activation quantisation in the block-FP8 Linears of the text
        model (the oracle for the FP8 kernels); refused for a model without FP8 weights, where it would mean nothing.
        kv_cache_dtype "fp8_e4m3": the full-attention layers' K and V are stored as e4m3 with a scale per (token,
        kv head) (reference/fp8_kv.py), independent of the weights' dtype; the MTP head's KV layer and the
        linear-attention states stay float32."""
        if fp8_activations and not weights.fp8_names():
            raise ValueError("fp8_activations=True needs block-FP8 weights (an FP8 checkpoint, or quantize='fp8')")
        check_kv_cache_dtype(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.config = model_config
        self.weights = weights
        self.text = TextModel(model_config.text, weights, fp8_activations=fp8_activations)
        self.spec: CacheSpec | None = None
        self.k_cache: dict[int, KvArray] = {}
        self.v_cache: dict[int, KvArray] = {}
        self.conv_state: dict[int, np.ndarray] = {}
        self.recurrent_state: dict[int, np.ndarray] = {}
        self._vision_tower: Any = None
        # MTP head (checkpoints with all of the head's mtp.*, dense or MoE): its own KV layer in every block. A
        # checkpoint without a complete head still loads; it just has no MTP drafter.
        usable = bool(weights.mtp) and has_complete_head(model_config.text, weights.mtp)
        self.mtp = MtpHead(model_config.text, weights.mtp, self.text.embed, self.text.lm_head) if usable else None
        self.mtp_head = self.mtp is not None
        self.mtp_k = np.zeros(0, np.float32)
        self.mtp_v = np.zeros(0, np.float32)
        self._windows: dict[int, list[list[np.ndarray]]] = {}  # state slot -> states after each verified token
        # seq id -> (start, hidden rows, input rows, their token ids) of its last forward, kept for mtp_draft until
        # the next forward; state slot -> the same for its last keep_hidden row: a prompt chunk's last position waits
        # for the next chunk, whose first input row (an image's, maybe) is the head's "next token" there
        self._hidden: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._last_row: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}
        # Optional override of the DeltaNet form (None: recurrent for 1 token, chunked otherwise). Tests set it.
        self.deltanet_recurrent: bool | None = None

    # ------------------------------------------------------------------------------------------------ sizes

    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        """Bytes of one KV block over all full-attention layers; `block_size` is needed before allocate_cache."""
        size = block_size if block_size is not None else allocated(self.spec).block_size
        t = self.config.text
        mtp = 2 * size * t.num_key_value_heads * t.head_dim * _F32 if self.mtp is not None else 0
        if self.kv_cache_dtype == "fp8_e4m3":  # one byte per element + a float32 scale per (token, kv head)
            per_token = 2 * t.num_key_value_heads * (t.head_dim + SCALE_BYTES)
            return len(t.full_attention_layers) * size * per_token + mtp
        return kv_bytes_per_block(t, size, _F32) + mtp

    def state_bytes_per_slot(self) -> int:
        return state_bytes_per_slot(self.config.text, _F32, _F32)

    def embedding_nbytes(self, item: VisionItem) -> int:
        return item.num_tokens * self.config.text.hidden_size * _F32

    # ------------------------------------------------------------------------------------------------ cache

    def allocate_cache(self, spec: CacheSpec) -> None:
        check_cache_spec(spec)
        t = self.config.text
        self.spec = spec
        kv_shape = (spec.num_kv_blocks, spec.block_size, t.num_key_value_heads, t.head_dim)
        self.k_cache = {i: kv_array(self.kv_cache_dtype, kv_shape) for i in t.full_attention_layers}
        self.v_cache = {i: kv_array(self.kv_cache_dtype, kv_shape) for i in t.full_attention_layers}
        conv_shape = (spec.num_state_slots, t.linear_conv_dim, t.linear_conv_kernel_dim - 1)
        rec_shape = (spec.num_state_slots, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim)
        self.conv_state = {i: np.zeros(conv_shape, np.float32) for i in t.linear_attention_layers}
        self.recurrent_state = {i: np.zeros(rec_shape, np.float32) for i in t.linear_attention_layers}
        if self.mtp is not None:
            self.mtp_k = np.zeros(kv_shape, np.float32)
            self.mtp_v = np.zeros(kv_shape, np.float32)
        self._windows.clear()
        self._hidden.clear()

    def copy_state_slot(self, src: int, dst: int) -> None:
        check_state_slots(allocated(self.spec), src, dst)
        for layer in self.conv_state:
            self.conv_state[layer][dst] = self.conv_state[layer][src]
            self.recurrent_state[layer][dst] = self.recurrent_state[layer][src]

    # ------------------------------------------------------------------------------------------------ steps

    def forward(self, batch: StepBatch) -> StepOutput:
        spec = allocated(self.spec)
        rows: list[np.ndarray] = []
        offsets = row_offsets(batch.chunks)
        self._hidden.clear()  # kept hidden states live until the next forward
        for i, chunk in enumerate(batch.chunks):
            check_chunk(chunk, spec, self.config.text)
            if chunk.verify and chunk.vision:
                raise RunnerInputError(f"sequence {chunk.seq_id}: a verify window carries no vision rows")
            # a slot's verify window lives until the slot's next forward (failure isolation re-runs parts of a step:
            # the window of a chunk is the one of its last run)
            self._windows.pop(chunk.state_slot, None)
            hidden = self._run_verify(chunk) if chunk.verify else self._run_chunk(chunk)
            if chunk.keep_hidden:
                self._keep_hidden(chunk, hidden)
            rows.append(hidden[hidden.shape[0] - (offsets[i + 1] - offsets[i]):])  # all, the last or no rows
        hidden_rows = np.concatenate(rows, axis=0) if rows else np.zeros((0, self.config.text.hidden_size), np.float32)
        logits = self.text.logits(hidden_rows)
        if batch.sampling is None:
            return StepOutput(logits=logits, row_offsets=offsets, hidden=hidden_rows)
        problem = batch.sampling.problem(logits.shape[0], logits.shape[1])
        if problem:
            raise RunnerInputError(problem)
        return StepOutput(logits=logits[:0], row_offsets=offsets, hidden=hidden_rows,
                          sampled=sample_on_host(logits, batch.sampling))

    def launch(self, batch: StepBatch, previous: SamplingRequest | None,
               feed: np.ndarray | None) -> SampleResult | None:
        """runner_api's lookahead launch: the step before is sampled (its tokens returned, fed to `feed`'s
        chunks), then this one runs, its logits kept until finish() / the next launch samples them."""
        sampled = self.finish(previous) if previous is not None else None
        if self._launched is not None:
            raise RunnerInputError("a launched step has not been sampled: pass its request as `previous`")
        chunks = fed_chunks(batch.chunks, feed, None if sampled is None else sampled.token_ids)
        self._launched = self.forward(StepBatch(chunks)).logits
        return sampled

    def finish(self, request: SamplingRequest) -> SampleResult:
        logits, self._launched = self._launched, None
        if logits is None:
            raise RunnerInputError("no launched step to sample")
        problem = request.problem(logits.shape[0], logits.shape[1])
        if problem:
            raise RunnerInputError(problem)
        return sample_on_host(logits, request)

    def _run_chunk(self, chunk: SeqChunk) -> np.ndarray:
        slot = chunk.state_slot
        if chunk.start == 0:  # a fresh sequence: nothing of a previous owner of this slot may leak in
            for layer in self.conv_state:
                self.conv_state[layer][slot] = 0.0
                self.recurrent_state[layer][slot] = 0.0
        embeds = self._embeds(chunk)
        cache = SequenceCache(
            start=chunk.start,
            block_table=np.asarray(chunk.block_table, dtype=np.int64),
            kv={i: (self.k_cache[i], self.v_cache[i]) for i in self.k_cache},
            conv={i: s[slot] for i, s in self.conv_state.items()},
            recurrent={i: s[slot] for i, s in self.recurrent_state.items()},
        )
        return self.text.forward(embeds, chunk.positions, cache, recurrent=self.deltanet_recurrent)

    def _keep_hidden(self, chunk: SeqChunk, hidden: np.ndarray) -> None:
        embeds = self._embeds(chunk)  # the head embeds a next token as the trunk did: vision rows included
        tokens = np.array(chunk.token_ids, np.int64)  # a copy: the engine's view is rewritten by accepted tokens
        start, prev = chunk.start, self._last_row.get(chunk.state_slot)
        if prev is not None and prev[0] == start - 1 and start > 0:
            start = start - 1
            hidden, embeds = np.concatenate([prev[1], hidden]), np.concatenate([prev[2], embeds])
            tokens = np.concatenate([prev[3], tokens])
        self._hidden[chunk.seq_id] = (start, hidden, embeds, tokens)
        self._last_row[chunk.state_slot] = (chunk.start + chunk.num_tokens - 1, hidden[-1:], embeds[-1:], tokens[-1:])

    def _embeds(self, chunk: SeqChunk) -> np.ndarray:
        """The chunk's input embeddings: token embeddings, vision embeddings over the placeholders."""
        embeds = self.text.embed_tokens(chunk.token_ids)
        for piece in chunk.vision:
            emb = np.asarray(piece.embeddings, dtype=np.float32)
            embeds[piece.chunk_offset:piece.chunk_offset + emb.shape[0]] = emb
        return embeds

    def _run_verify(self, chunk: SeqChunk) -> np.ndarray:
        """A verify window token by token (the arithmetic of decode steps), keeping the state after each token."""
        rows, window = [], []
        for i in range(chunk.num_tokens):
            one = SeqChunk(seq_id=chunk.seq_id, token_ids=chunk.token_ids[i:i + 1],
                           positions=chunk.positions[:, i:i + 1], start=chunk.start + i,
                           block_table=chunk.block_table, state_slot=chunk.state_slot)
            rows.append(self._run_chunk(one))
            window.append([s[chunk.state_slot].copy() for s in (*self.conv_state.values(),
                                                                  *self.recurrent_state.values())])
        self._windows[chunk.state_slot] = window
        return np.concatenate(rows, axis=0)

    def rollback_state(self, state_slot: int, keep_tokens: int) -> None:
        window = self._windows.get(state_slot)
        if window is None or not 1 <= keep_tokens <= len(window):
            have = 0 if window is None else len(window)
            raise RunnerInputError(f"state slot {state_slot}: cannot keep {keep_tokens} tokens of a verify window "
                                   f"of {have} (rollback_state comes right after the verify forward)")
        states = window[keep_tokens - 1]
        for dst, src in zip((*self.conv_state.values(), *self.recurrent_state.values()), states):
            dst[state_slot] = src

    def mtp_draft(self, requests: list[MtpDraftRequest]) -> list[list[int]]:
        if self.mtp is None:
            raise RunnerInputError("this checkpoint has no MTP head (mtp.* weights)")
        out = []
        for r in requests:
            kept = self._hidden.pop(r.seq_id, None)
            n = int(r.next_tokens.shape[0])
            if kept is None or not kept[0] <= r.start or r.start + n > kept[0] + kept[1].shape[0] or n < 1:
                raise RunnerInputError(f"sequence {r.seq_id}: mtp_draft needs the hidden states of positions "
                                       f"[{r.start}, {r.start + n}) from its last forward (keep_hidden)")
            first = r.start - kept[0]
            hidden, rows, row_tokens = kept[1][first:first + n], kept[2][first + 1:], kept[3][first + 1:]
            tokens = np.asarray(r.next_tokens, np.int64)
            next_embeds = self.mtp.embed[tokens].astype(np.float32)
            # a next token that ran in the kept rows (not a rejected draft's place) is embedded as it ran there
            inside = min(n, rows.shape[0])
            same = np.nonzero(row_tokens[:inside] == tokens[:inside])[0]
            next_embeds[same] = rows[same]
            out.append(self.mtp.draft(tokens, hidden, r.positions, self.mtp_k, self.mtp_v,
                                      np.asarray(r.block_table, np.int64), r.start, r.num_drafts, next_embeds))
        return out

    # ------------------------------------------------------------------------------------------------ vision

    def encode_vision(self, item: VisionItem) -> np.ndarray:
        """Vision tower for one item -> [item.num_tokens, text hidden] float32."""
        out = np.asarray(self._tower().encode(item.pixel_values, item.grid_thw), dtype=np.float32)
        if out.shape != (item.num_tokens, self.config.text.hidden_size):
            raise RunnerInputError(
                f"vision item at token {item.token_start}: tower gave {out.shape}, expected "
                f"({item.num_tokens}, {self.config.text.hidden_size})"
            )
        return out

    def encode_vision_batch(self, items: list[VisionItem]) -> list[np.ndarray]:
        """Items of one grid (1, h, w) in one tower call (vision_batch.py): each item's rows, in order."""
        pixels, grid = stacked(items)
        out = np.asarray(self._tower().encode(pixels, grid), dtype=np.float32)
        if out.shape != (sum(i.num_tokens for i in items), self.config.text.hidden_size):
            raise RunnerInputError(f"vision batch of {len(items)} items: tower gave {out.shape}")
        return [out[a:b] for a, b in row_ranges(items)]

    def _tower(self) -> Any:
        if self._vision_tower is None:
            from .vision_tower import VisionTower  # written separately; imported only when vision is used

            self._vision_tower = VisionTower(self.config.vision, self.weights.vision)
        return self._vision_tower

