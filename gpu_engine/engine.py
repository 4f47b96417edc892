"""Engine: requests in, streamed and final RequestOutputs out; one `step()` = one forward of the runner.

    engine = Engine.from_pretrained("ckpt/", runner="reference", config=EngineConfig(max_num_seqs=16))
    rid = engine.add_request(messages, SamplingParams(max_tokens=64, json_schema=schema))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.delta, out.finish_reason)

Not thread-safe: one thread drives it (see AsyncEngine for many callers).

Failures stay with their request: a bad image, a grammar dead end or a timeout ends that request with
finish_reason "error"; a forward that raises is re-run in halves to find the request(s) that make it fail
(Engine._isolate_failure), and only those end with the runner's error.

Sampling happens on the runner when it can (runner.samples_on_device and no row of the step has a repetition or
presence penalty): the engine draws each sampled row's uniform and builds the grammar bitmask before the forward,
sends them as a SamplingRequest and gets token ids (+ logprobs) back instead of logits. Otherwise the runner
returns logits and gpu_engine.sampling samples them here. Everything after the token is chosen is shared.
"""
from __future__ import annotations

import itertools
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence as SequenceABC
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cache import BlockManager
from .cuda.options import CudaOptions
from .encoder_cache import EncoderCache
from .engine_config import EngineConfig, EngineConfigError
from .errors import InvalidRequestError
from .inputs import ProcessedPrompt
from .params import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from .rope_index import text_positions
from .runner_api import CacheSpec, Runner, SamplingRequest, SeqChunk, StepBatch, StepOutput
from .sampling import (
    Drawn, SampleResult, SamplingRows, apply_bitmask_rows, apply_penalties, bitmask_to_bool, sample,
)
from .scheduler import ScheduledChunk, Scheduler
from .sequence import Sequence, SeqStatus
from .structured import GrammarError, StructuredOutput, is_constrained
from .tokenizer import IncrementalDetokenizer, byte_level_token_bytes

Prompt = list[dict[str, Any]] | SequenceABC[int] | np.ndarray | ProcessedPrompt


class RequestError(InvalidRequestError, ValueError):
    """A request that can never run as given (bad prompt, bad parameters, too long for this engine)."""


@dataclass
class _StepTimes:
    count: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.last_s = seconds
        self.max_s = max(self.max_s, seconds)


@dataclass
class _RunnerSampling:
    """What the engine prepared for sampling on the runner in one step."""

    request: SamplingRequest
    row_of_chunk: dict[int, int]  # chunk index -> its row of the request
    dead: list[Sequence]  # grammar allows no token: sent unconstrained, token discarded, the request ends


Rows = np.ndarray | SampleResult  # one step's logits rows, or the rows the runner sampled


class Engine:
    def __init__(
        self,
        runner: Runner,
        tokenizer: Any,
        *,
        vocab_size: int,
        config: EngineConfig | None = None,
        prepare: Callable[[list[dict[str, Any]]], ProcessedPrompt] | None = None,
        model_fingerprint: str = "",
        eos_token_ids: SequenceABC[int] | None = None,
        model_max_len: int | None = None,
    ) -> None:
        """`tokenizer`: gpu_engine.tokenizer.Tokenizer (decode + tokenizer.json for grammars); `prepare`: messages ->
        ProcessedPrompt (the processor; None = token-id / ProcessedPrompt prompts only); `model_max_len`: the
        model's own context limit (max_position_embeddings), a cap on top of EngineConfig.max_model_len."""
        self.config = config or EngineConfig()
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_fingerprint = model_fingerprint
        self._prepare = prepare
        self.eos_token_ids = frozenset(int(t) for t in (eos_token_ids if eos_token_ids is not None else tokenizer.eos_token_ids))

        cfg = self.config
        self._kv_bytes_per_block = int(runner.kv_bytes_per_block(block_size=cfg.block_size))
        state_bytes = int(runner.state_bytes_per_slot())
        num_slots = cfg.state_slots
        limits = [x for x in (cfg.max_model_len, model_max_len) if x is not None]
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif self._kv_bytes_per_block == 0:
            # No full-attention layers: blocks cost nothing, only bookkeeping; enough for every sequence at full length.
            num_blocks = cfg.max_num_seqs * -(-min(limits, default=32768) // cfg.block_size)
        else:
            left = cfg.cache_budget_bytes - num_slots * state_bytes
            per_block = self._kv_bytes_per_block
            if left < per_block:
                raise EngineConfigError(
                    f"kv_cache_bytes={cfg.cache_budget_bytes} is too small: {num_slots} state slots take "
                    f"{num_slots * state_bytes} bytes and one KV block {self._kv_bytes_per_block} bytes"
                )
            num_blocks = left // per_block
        self.cache_bytes = num_blocks * self._kv_bytes_per_block + num_slots * state_bytes
        runner.allocate_cache(CacheSpec(num_kv_blocks=num_blocks, block_size=cfg.block_size, num_state_slots=num_slots))
        capacity = num_blocks * cfg.block_size
        self.max_model_len = min([capacity, *limits])

        self.blocks = BlockManager(
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            num_state_slots=num_slots,
            enable_prefix_caching=cfg.enable_prefix_caching,
            has_linear_state=state_bytes > 0,
            copy_state_slot=runner.copy_state_slot,
        )
        self.encoder = EncoderCache(cfg.encoder_cache_bytes, runner.encode_vision, runner.embedding_nbytes)
        self.scheduler = Scheduler(cfg, self.blocks, self.encoder)
        self._structured: StructuredOutput | None = None
        self._token_bytes: list[bytes] | None = None  # for the detokenizer's byte path (ByteLevel tokenizers)
        self._token_bytes_checked = False

        self._live: dict[str, Sequence] = {}
        self._with_deadline: dict[str, Sequence] = {}  # live requests with a timeout_s
        self._pending: list[RequestOutput] = []  # finished outside step() (abort): delivered by the next step()
        self._seq_ids = itertools.count()
        self._seed_rng = np.random.default_rng(cfg.seed)
        self._counters = {
            "requests_added": 0,
            "requests_finished": 0,
            "finished_stop": 0,
            "finished_length": 0,
            "finished_abort": 0,
            "finished_error": 0,
            "steps": 0,
            "prompt_tokens_computed": 0,  # prompt tokens run through the model (prefix-cache hits excluded)
            "chunked_output_tokens": 0,  # generated tokens run in chunks: jump-forward runs, recompute after preemption
            "decode_tokens": 0,  # tokens run as single decode steps
            "forced_tokens": 0,  # jump-forward tokens appended without sampling
            "sampled_tokens": 0,
            # Request isolation: forwards that raised, the re-runs that located the failing requests, requests
            # ended by the runner's error, and survivors preempted to rebuild linear-attention state.
            "forward_failures": 0,
            "isolation_forwards": 0,
            "requests_failed_by_runner": 0,
            "preempted_after_failure": 0,
        }
        self._step_times = _StepTimes()
        # (time to first token, end-to-end latency) of the most recent finished requests, for p50 / p95.
        self._latencies: deque[tuple[float, float]] = deque(maxlen=1000)
        # What one forward had to hold (the runner's activations scale with these): tokens and vision rows.
        self._peak_step_tokens = 0
        self._peak_step_vision_rows = 0
        self._mask_s = 0.0
        self._sample_s = 0.0
        self._forward_s = 0.0
        # Uniforms drawn for a runner-sampled row whose token was never used (the sequence was preempted after a
        # failed forward): its next sampled token uses it, so a seeded request still draws one uniform per token.
        self._unused_uniform: dict[int, float] = {}

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        runner: str = "reference",
        config: EngineConfig | None = None,
        *,
        expected_digests: dict[str, str] | None = None,
        cuda_options: CudaOptions | None = None,
    ) -> Engine:
        """`cuda_options`: settings of the cuda runner (see gpu_engine.model.load)."""
        from .model import load
        from .tokenizer import Tokenizer

        loaded = load(folder, runner=runner, expected_digests=expected_digests, cuda_options=cuda_options)
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
        )

    @property
    def structured(self) -> StructuredOutput:
        if self._structured is None:  # built on first use: ~10 ms for a tiny vocabulary, ~1 s for a real one
            self._structured = StructuredOutput(
                self.tokenizer.backend.to_str(),
                self.vocab_size,
                sorted(self.eos_token_ids),
                whitespace_flexible=self.config.json_whitespace_flexible,
            )
        return self._structured

    @property
    def token_bytes(self) -> list[bytes] | None:
        """Every token's bytes (None: the tokenizer is not plain byte-level), built on first use: lets the
        detokenizer skip a tokenizer call per generated token."""
        if not self._token_bytes_checked:
            self._token_bytes = byte_level_token_bytes(self.tokenizer, self.vocab_size, skip_special_tokens=True)
            self._token_bytes_checked = True
        return self._token_bytes

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; bad input raises RequestError here (nothing is queued)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._live:
            raise RequestError(f"request id {request_id!r} is already in use")
        processed = self.prepare_prompt(prompt)
        self._check_request(processed, params)
        matcher = None
        if is_constrained(params):
            try:
                matcher = self.structured.new_matcher(params)
            except GrammarError as exc:
                raise RequestError(str(exc)) from exc
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**63))
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt=processed,
            params=params,
            rng=np.random.default_rng(seed),
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
        )
        seq.deadline = seq.arrival_time + params.timeout_s if params.timeout_s is not None else None
        seq.matcher = matcher
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True, token_bytes=self.token_bytes)
        if matcher is not None and self.config.enable_jump_forward:
            # The grammar may force the first tokens (e.g. '{"name":"'): they are prefilled with the prompt.
            # Capped one short of max_tokens so that the request still has a token to sample.
            for token in StructuredOutput.forced_tokens(matcher, seq.remaining_tokens - 1):
                self._counters["forced_tokens"] += 1
                self._append(seq, token, forced=True)
        self._live[request_id] = seq
        if seq.deadline is not None:
            self._with_deadline[request_id] = seq
        self.scheduler.add(seq)
        self._counters["requests_added"] += 1
        return request_id

    def prepare_prompt(self, prompt: Prompt) -> ProcessedPrompt:
        """Messages / token ids -> ProcessedPrompt (chat template, media decoding). Touches no engine state, so
        front ends may call it on their own threads (AsyncEngine does: media decoding never stalls the step loop)."""
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, np.ndarray) or (
            isinstance(prompt, SequenceABC) and not isinstance(prompt, (str, bytes)) and prompt
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt)
        ):
            ids = np.asarray(prompt)
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise RequestError(f"token-id prompts must be a 1-D list of ints, got shape {ids.shape} {ids.dtype}")
            ids = ids.astype(np.int64)
            positions = text_positions(ids.size)
            return ProcessedPrompt(token_ids=ids, positions=positions, rope_delta=0, vision_items=[])
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            if self._prepare is None:
                raise RequestError("this engine has no processor: pass token ids or a ProcessedPrompt")
            try:
                return self._prepare(prompt)
            except Exception as exc:  # the processor's own errors say what is wrong with the messages
                raise RequestError(f"cannot prepare the messages: {exc}") from exc
        raise RequestError(
            "prompt must be a non-empty list of chat messages (dicts), a non-empty list of token ids, "
            f"or a ProcessedPrompt; got {type(prompt).__name__}"
        )

    def _check_request(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        n = len(prompt)
        if n == 0:
            raise RequestError("the prompt is empty")
        ids = prompt.token_ids
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if prompt.positions.shape != (3, n):
            raise RequestError(f"prompt positions must have shape (3, {n}), got {prompt.positions.shape}")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds this engine's limit of "
                f"{self.max_model_len} tokens (KV cache capacity / max_model_len); lower max_tokens or shorten the prompt"
            )
        if params.top_logprobs > self.config.max_logprobs:
            raise RequestError(f"top_logprobs={params.top_logprobs} exceeds max_logprobs={self.config.max_logprobs}")
        if isinstance(params.stop, str) or isinstance(params.stop_token_ids, int):
            raise RequestError("stop must be a list of strings and stop_token_ids a list of ints")
        bad = [t for t in params.stop_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        if any(not isinstance(s, str) or not s for s in params.stop):
            raise RequestError("stop strings must be non-empty strings")
        if params.timeout_s is not None and params.timeout_s <= 0:
            raise RequestError(f"timeout_s must be > 0, got {params.timeout_s}")
        end = 0
        for item in prompt.vision_items:
            if item.token_start < end or item.token_end > n:
                raise RequestError("vision items must be ordered, non-overlapping and inside the prompt")
            end = item.token_end
            size = self.encoder.item_bytes(item)
            if size > self.config.encoder_cache_bytes:
                raise RequestError(
                    f"a {item.kind} item needs {size} bytes of embeddings, more than encoder_cache_bytes="
                    f"{self.config.encoder_cache_bytes}; raise the budget or send smaller images / fewer frames per group"
                )

    def abort(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes with the next step(). False if unknown."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._pending.append(self._finish(seq, "abort"))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._pending)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        if self._with_deadline:
            now = time.monotonic()
            for seq in [s for s in self._with_deadline.values() if now > s.deadline]:  # type: ignore[operator]
                outputs.append(self._finish(seq, "error", f"timed out after {seq.params.timeout_s} s"))

        sched = self.scheduler.schedule()
        chunks: list[SeqChunk] = []
        scheduled: list[ScheduledChunk] = []
        # Decode positions for the whole step in one array (one numpy call instead of one per sequence).
        decode_pos = np.array(
            [sc.start + sc.seq.prompt.rope_delta if sc.is_decode else 0 for sc in sched.chunks], dtype=np.int64
        )
        decode_pos = np.broadcast_to(decode_pos, (3, decode_pos.shape[0])).copy()
        for k, sc in enumerate(sched.chunks):
            try:
                vision = self.encoder.slices(sc.vision_items, sc.start, sc.end) if sc.vision_items else []
            except Exception as exc:  # one bad image must not stop the batch
                outputs.append(self._finish(sc.seq, "error", f"vision encoding failed: {exc}"))
                continue
            seq = sc.seq
            chunks.append(SeqChunk(
                seq_id=seq.seq_id,
                token_ids=seq.token_slice(sc.start, sc.end),
                positions=decode_pos[:, k : k + 1] if sc.is_decode
                else seq.positions(sc.start, sc.num_tokens),
                start=sc.start,
                block_table=seq.block_table_array(),
                state_slot=seq.state_slot,  # type: ignore[arg-type]
                vision=vision,
                logits="last" if sc.wants_logits else "none",
            ))
            scheduled.append(sc)
        self.encoder.release()
        if chunks:
            self._peak_step_tokens = max(self._peak_step_tokens, sum(sc.num_tokens for sc in scheduled))
            if any(c.vision for c in chunks):
                vision_rows = sum(int(v.embeddings.shape[0]) for c in chunks for v in c.vision)
                self._peak_step_vision_rows = max(self._peak_step_vision_rows, vision_rows)
            plan = self._runner_sampling(scheduled)
            tf = time.perf_counter()
            try:
                result = self.runner.forward(StepBatch(chunks, sampling=plan.request if plan else None))
                rows: Rows = result.logits if plan is None else self._sampled(result)
                offsets = result.row_offsets
            except Exception as exc:
                scheduled, rows, offsets = self._isolate_failure(chunks, scheduled, exc, outputs, plan)
            self._forward_s += time.perf_counter() - tf
            if scheduled:
                outputs.extend(self._after_forward(scheduled, rows, offsets, plan))
        self._counters["steps"] += 1
        self._step_times.add(time.perf_counter() - t0)
        return outputs

    def _runner_sampling(self, scheduled: list[ScheduledChunk]) -> _RunnerSampling | None:
        """The SamplingRequest for this step when the runner can sample every row of it, else None (host path).

        Draws each sampled row's uniform now (one per sampled token, as the host sampler does) and fills the
        grammar bitmask of constrained rows; a row whose grammar allows nothing is sent unconstrained and marked
        dead (its token is discarded, exactly like the host path's all-zero row)."""
        if not getattr(self.runner, "samples_on_device", False):
            return None
        picked = [(i, sc.seq) for i, sc in enumerate(scheduled) if sc.wants_logits]
        if not picked:
            return None
        seqs = [s for _, s in picked]
        rows = SamplingRows.from_rows([s.sampling_row for s in seqs])
        if rows.has_penalties:
            return None
        uniform = np.zeros(len(seqs), np.float64)
        for r in np.nonzero(rows.temperature > 0.0)[0]:
            uniform[r] = float(self._rng(seqs[r]).random())
        bitmask = mask_index = None
        dead: list[Sequence] = []
        constrained = [(s.matcher, r) for r, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            tm = time.perf_counter()
            bitmask = self.structured.bitmask([(m, j) for j, (m, _) in enumerate(constrained)], len(constrained))
            mask_index = np.full(len(seqs), -1, np.int64)
            allows_any = bitmask_to_bool(bitmask, self.vocab_size).any(axis=1)
            for j, (_, r) in enumerate(constrained):
                if allows_any[j]:
                    mask_index[r] = j
                else:
                    dead.append(seqs[r])
            self._mask_s += time.perf_counter() - tm
        request = SamplingRequest(
            temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p, min_p=rows.min_p, uniform=uniform,
            num_logprobs=rows.num_logprobs, bitmask=bitmask, mask_index=mask_index,
        )
        return _RunnerSampling(request, {i: r for r, (i, _) in enumerate(picked)}, dead)

    def _rng(self, seq: Sequence) -> Any:
        """`seq`'s own Generator, or a stand-in returning the uniform drawn for it and left unused (consumed)."""
        u = self._unused_uniform.pop(seq.seq_id, None)
        return seq.rng if u is None else Drawn(u)

    def _sampled(self, result: StepOutput) -> SampleResult:
        if result.sampled is None:
            raise RuntimeError(f"runner {self.runner.name!r} was asked to sample but returned no sampled rows")
        return result.sampled

    def _isolate_failure(
        self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk], error: Exception, outputs: list[RequestOutput],
        plan: _RunnerSampling | None = None,
    ) -> tuple[list[ScheduledChunk], Rows, list[int]]:
        """The forward of the whole step raised. Find the request(s) that make it fail by re-running the chunks in
        halves (bisection), end only those with the error, and return what the others may keep: the chunks whose
        retried rows are valid, their logits and row offsets (for _after_forward).

        What a failed forward may have half-written: KV of positions >= each chunk's start (never part of a
        committed or shared block, and rewritten by the retry: harmless) and the linear-attention state slots of
        the batch, which are updated in place — a retry would apply the chunk twice. So on hybrid models every
        surviving chunk that continues a sequence (start > 0) is preempted instead: its cache is dropped and it is
        recomputed from its tokens, exactly as after a cache-pressure preemption. A chunk with start == 0 restarts
        its state anyway (the runner zeroes the slot), so its retried rows are kept.
        With runner sampling, each re-run carries its chunks' rows of the step's SamplingRequest (the same
        uniforms); a preempted survivor keeps its unused uniform for its next token."""
        self._counters["forward_failures"] += 1
        rows: dict[int, Rows] = {}
        failed: dict[int, Exception] = {}
        self._bisect(chunks, list(range(len(chunks))), error, rows, failed, plan)
        stateful = self.blocks.has_linear_state
        kept: list[ScheduledChunk] = []
        kept_rows: list[Rows] = []
        offsets = [0]
        tainted: list[Sequence] = []
        for i, sc in enumerate(scheduled):
            if i in failed:
                exc = failed[i]
                self._counters["requests_failed_by_runner"] += 1
                outputs.append(self._finish(sc.seq, "error", f"runner failed: {type(exc).__name__}: {exc}"))
            elif stateful and sc.start > 0:
                tainted.append(sc.seq)
                row = plan.row_of_chunk.get(i) if plan is not None else None
                if plan is not None and row is not None and plan.request.temperature[row] > 0.0:
                    self._unused_uniform[sc.seq.seq_id] = float(plan.request.uniform[row])
            else:
                kept.append(sc)
                kept_rows.append(rows[i])
                offsets.append(offsets[-1] + _num_rows(rows[i]))
        for seq in reversed(tainted):  # reversed: the oldest ends up first in the waiting queue
            self.scheduler.preempt(seq)
        self._counters["preempted_after_failure"] += len(tainted)
        if plan is not None:
            return kept, _concat_sampled(kept_rows), offsets
        logits = np.concatenate(kept_rows) if kept_rows else np.zeros((0, self.vocab_size), np.float32)
        return kept, logits, offsets

    def _bisect(
        self, chunks: list[SeqChunk], group: list[int], error: Exception, rows: dict[int, Rows],
        failed: dict[int, Exception], plan: _RunnerSampling | None = None,
    ) -> None:
        """`group` (indices into `chunks`) failed with `error`: a single chunk is a culprit; a larger group is split
        and each half re-run. Fills `rows` (chunk index -> its logit rows, or its sampled rows under `plan`) for
        chunks that ran, `failed` for culprits. A group that fails for one poisoned request costs about
        2 log2(batch) extra forwards."""
        if len(group) == 1:
            failed[group[0]] = error
            return
        mid = len(group) // 2
        for half in (group[:mid], group[mid:]):
            self._counters["isolation_forwards"] += 1
            sampling = None
            if plan is not None:
                sampling = plan.request.select([plan.row_of_chunk[i] for i in half if i in plan.row_of_chunk])
            try:
                result = self.runner.forward(StepBatch([chunks[i] for i in half], sampling=sampling))
                sampled = self._sampled(result) if plan is not None else None
            except Exception as exc:
                self._bisect(chunks, half, exc, rows, failed, plan)
                continue
            for k, i in enumerate(half):
                a, b = result.row_offsets[k], result.row_offsets[k + 1]
                if sampled is not None:
                    rows[i] = SampleResult(sampled.token_ids[a:b].copy(), sampled.logprobs[a:b].copy(), sampled.top[a:b])
                else:  # copied: a runner may hand back the same host buffer from its next forward
                    rows[i] = np.array(result.logits[a:b], copy=True)

    def _after_forward(self, scheduled: list[ScheduledChunk], logits: Rows, offsets: list[int],
                       plan: _RunnerSampling | None = None) -> list[RequestOutput]:
        to_sample: list[tuple[Sequence, int]] = []
        for i, sc in enumerate(scheduled):
            seq = sc.seq
            self._count_computed(sc)
            seq.num_computed = sc.end
            if seq.num_computed % self.config.block_size == 0 or sc.num_tokens > 1:
                self.blocks.commit(seq)  # only when a block may have filled up
                if seq.num_computed <= seq.prompt_len:
                    self.blocks.snapshot_state(seq)
            if sc.wants_logits:
                to_sample.append((seq, offsets[i]))
        if not to_sample:
            return []
        seqs = [s for s, _ in to_sample]
        index = [r for _, r in to_sample]
        if isinstance(logits, SampleResult):  # the runner sampled: one row per chunk that wanted logits
            dead = plan.dead if plan is not None else []
            return self._deliver(seqs, logits.token_ids[index].tolist(), logits.logprobs[index].tolist(),
                                 [logits.top[r] for r in index], dead)
        if index == list(range(logits.shape[0])):
            rows = logits  # the usual case: every row is sampled; copied below only if it must be modified
        else:
            rows = logits[index]
        return self._sample_and_append(seqs, rows)

    def _count_computed(self, sc: ScheduledChunk) -> None:
        seq = sc.seq
        if sc.is_decode:
            self._counters["decode_tokens"] += 1
            return
        in_prompt = max(0, min(sc.end, seq.prompt_len) - sc.start)
        self._counters["prompt_tokens_computed"] += in_prompt
        self._counters["chunked_output_tokens"] += sc.num_tokens - in_prompt

    def _sample_and_append(self, seqs: list[Sequence], logits: np.ndarray) -> list[RequestOutput]:
        """`logits` may be the runner's own array: it is copied before anything is written into it."""
        rows = SamplingRows.from_rows([s.sampling_row for s in seqs])
        constrained = [(s.matcher, i) for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained or rows.has_penalties:
            logits = np.array(logits, dtype=np.float32, copy=True)
            apply_penalties(logits, rows, [s.token_ids for s in seqs], [s.output_ids for s in seqs])
        dead: list[Sequence] = []
        if constrained:
            tm = time.perf_counter()
            # One bitmask for all constrained rows of the step (llguidance fills them together).
            bitmask = self.structured.bitmask([(m, j) for j, (m, _) in enumerate(constrained)], len(constrained))
            cidx = [i for _, i in constrained]
            allowed = apply_bitmask_rows(logits, cidx, bitmask)
            for j in np.nonzero(~allowed.any(axis=1))[0]:
                dead.append(seqs[cidx[j]])
                logits[cidx[j]] = 0.0  # keeps the sampler free of all -inf rows; this row's token is discarded
            self._mask_s += time.perf_counter() - tm
        ts = time.perf_counter()
        # after a failed runner-sampled step some sequences have a uniform already drawn
        rngs: list[Any] = [self._rng(s) for s in seqs] if self._unused_uniform else [s.rng for s in seqs]
        result = sample(logits, rows, rngs)
        self._sample_s += time.perf_counter() - ts
        return self._deliver(seqs, result.token_ids.tolist(), result.logprobs.tolist(), result.top, dead)

    def _deliver(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float],
                 top: list[list[tuple[int, float]]], dead: list[Sequence]) -> list[RequestOutput]:
        """Sampled tokens (host or runner) -> appended, grammar advanced, stop conditions checked, outputs."""
        outputs = []
        self._counters["sampled_tokens"] += sum(1 for s in seqs if not (dead and s in dead))
        for i, seq in enumerate(seqs):
            if dead and seq in dead:
                err = seq.matcher.get_error() or "the grammar allows no further token"
                outputs.append(self._finish(seq, "error", f"structured output failed: {err}"))
                continue
            try:
                out = self._accept(seq, tokens[i], logprobs[i], top[i])
            except Exception as exc:  # a request-level failure (grammar, detokenizer) ends that request only
                out = self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            outputs.append(out)
        return outputs

    def _accept(self, seq: Sequence, token: int, logprob: float, top: list[tuple[int, float]]) -> RequestOutput:
        """Append a sampled token (+ any grammar-forced run after it) and decide whether the request is done."""
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        reason = self._append(seq, token, logprob=logprob, top=top)
        if reason is None and seq.matcher is not None:
            if not seq.matcher.consume_token(token):
                return self._finish(seq, "error", f"structured output failed: {seq.matcher.get_error()}")
            if seq.matcher.is_stopped():
                reason = "stop"
            elif self.config.enable_jump_forward:
                for forced in StructuredOutput.forced_tokens(seq.matcher, seq.remaining_tokens):
                    self._counters["forced_tokens"] += 1
                    reason = self._append(seq, forced, forced=True)
                    if reason is not None:
                        break
                if reason is None and seq.matcher.is_stopped():
                    reason = "stop"
        if reason is not None:
            return self._finish(seq, reason)
        return self._output(seq)

    def _append(
        self, seq: Sequence, token: int, *, logprob: float = 0.0, top: list[tuple[int, float]] | None = None,
        forced: bool = False,
    ) -> FinishReason | None:
        """Append one generated token; returns a finish reason when this token ends the request."""
        seq.append(token)
        if seq.logprobs is not None:
            # A forced token was the only one the grammar allowed: probability 1 under the constrained distribution.
            lp = 0.0 if forced else logprob
            seq.logprobs.append(TokenLogprob(
                token_id=token, text=self.tokenizer.decode([token]), logprob=lp,
                top=[(token, 0.0)] if forced and seq.params.top_logprobs else list(top or []),
            ))
        if token in seq.eos_token_ids or token in seq.params.stop_token_ids:
            return "stop"  # the stop token's text is not part of the output
        piece = seq.detok.push(token)
        if piece:
            seq.text += piece
            if seq.params.stop and self._cut_stop_string(seq, len(piece)):
                seq.stopped_by_string = True
                return "stop"
        if seq.num_tokens - seq.prompt_len >= seq.params.max_tokens:  # == remaining_tokens <= 0, without 2 calls
            return "length"
        return None

    @staticmethod
    def _cut_stop_string(seq: Sequence, new_chars: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        begin = max(0, len(seq.text) - new_chars - longest + 1)
        hits = [i for s in seq.params.stop if (i := seq.text.find(s, begin)) >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        return True

    # ------------------------------------------------------------------------------------------ outputs
    def _visible_text(self, seq: Sequence) -> str:
        """Text safe to show: while running, the tail that could still become a stop string is held back."""
        if seq.is_finished or not seq.params.stop:
            return seq.text
        hold = max(len(s) for s in seq.params.stop) - 1
        return seq.text[: max(seq.emitted_chars, len(seq.text) - hold)]

    def _output(self, seq: Sequence) -> RequestOutput:
        text = self._visible_text(seq)
        delta = text[seq.emitted_chars:]
        seq.emitted_chars = len(text)
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=seq.output_list[:],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            error=seq.error,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            prompt_tokens=seq.prompt_len,
            cached_prompt_tokens=seq.cached_prompt_tokens,
            delta=delta,
        )

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> RequestOutput:
        if not seq.stopped_by_string and seq.detok is not None:
            seq.text += seq.detok.flush()  # bytes held back for an incomplete character
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.monotonic()
        if seq.first_token_time is not None and reason in ("stop", "length"):
            self._latencies.append((seq.first_token_time - seq.arrival_time, seq.finish_time - seq.arrival_time))
        self._live.pop(seq.request_id, None)
        self._with_deadline.pop(seq.request_id, None)
        self._unused_uniform.pop(seq.seq_id, None)
        self._counters["requests_finished"] += 1
        self._counters[f"finished_{reason}"] += 1
        return self._output(seq)

    # ------------------------------------------------------------------------------------------ batch helper
    def generate(
        self, prompts: SequenceABC[Prompt] | Prompt, params: SamplingParams | SequenceABC[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion (together, continuously batched); final outputs in the order given.

        A request that fails while running comes back with finish_reason "error"; a request that is rejected up
        front raises RequestError (none of the prompts is then left queued)."""
        if isinstance(prompts, ProcessedPrompt) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict)):
            prompts = [prompts]  # one chat conversation
        elif isinstance(prompts, np.ndarray) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # one token-id prompt
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, plist):
                ids.append(self.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - final.keys():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    # ------------------------------------------------------------------------------------------ metrics
    def _latency_stats(self) -> dict[str, float | None]:
        """p50 / p95 of time to first token and latency over the last (up to 1000) completed requests."""
        if not self._latencies:
            return {"ttft_p50_s": None, "ttft_p95_s": None, "latency_p50_s": None, "latency_p95_s": None}
        arr = np.array(self._latencies)
        p = np.percentile(arr, [50, 95], axis=0)
        return {"ttft_p50_s": float(p[0, 0]), "ttft_p95_s": float(p[1, 0]),
                "latency_p50_s": float(p[0, 1]), "latency_p95_s": float(p[1, 1])}

    def stats(self) -> dict[str, Any]:
        st = self._step_times
        out: dict[str, Any] = dict(self._counters)
        out.update(self.blocks.stats())
        out.update(self.encoder.stats())
        out.update({
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "cache_bytes": self.cache_bytes,
            "max_model_len": self.max_model_len,
            "step_time_last_s": st.last_s,
            "step_time_mean_s": st.total_s / st.count if st.count else 0.0,
            "step_time_max_s": st.max_s,
            **self._latency_stats(),
            "peak_step_tokens": self._peak_step_tokens,
            "peak_step_vision_rows": self._peak_step_vision_rows,
            "forward_time_s": self._forward_s,
            "mask_time_s": self._mask_s,
            "sample_time_s": self._sample_s,
            "model_fingerprint": self.model_fingerprint,
        })
        return out


def _num_rows(rows: Rows) -> int:
    return len(rows.token_ids) if isinstance(rows, SampleResult) else int(rows.shape[0])


def _concat_sampled(parts: list[Rows]) -> SampleResult:
    """Sampled rows of the chunks kept after a failed forward, in order."""
    done = [p for p in parts if isinstance(p, SampleResult)]
    if not done:
        return SampleResult(np.zeros(0, np.int64), np.zeros(0, np.float32), [])
    return SampleResult(np.concatenate([p.token_ids for p in done]), np.concatenate([p.logprobs for p in done]),
                        [t for p in done for t in p.top])
