"""Engine: requests in, streamed and final RequestOutputs out; one `step()` = one forward of the runner.

    engine = Engine.from_pretrained("ckpt/", runner="reference", config=EngineConfig(max_num_seqs=16))
    rid = engine.add_request(messages, SamplingParams(max_tokens=64, json_schema=schema))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.delta, out.finish_reason)

Not thread-safe: one thread drives it (see AsyncEngine for many callers).

Failures stay with their request: a bad image, a grammar dead end or a timeout ends that request with
finish_reason "error"; a forward that raises is re-run in halves to find the request(s) that make it fail
(failure_isolation.py), and only those end with the runner's error.

Sampling happens on the runner when it can (samples_on_device, no repetition / presence penalty): the engine draws
each row's uniform and builds the grammar bitmask, sends them as a SamplingRequest and gets token ids (+ logprobs)
back; otherwise gpu_engine.sampling samples the runner's logits here. A runner that launches steps gets them with
their tokens taken in one step() later, the next step launched first (lookahead.py). Then the grammar
advances here, and output_processor.py turns tokens into text and RequestOutputs.
"""
from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

import numpy as np

from .batch_defaults import resolve_batching
from .cache import BlockManager
from .cache_sizing import cache_budget, size_cache
from .cuda.options import CudaOptions
from .encoder_cache import EncoderCache, default_encoder_budget
from .engine_config import EngineConfig
from .errors import RequestError
from .failure_isolation import FailureIsolation
from .forced_runs import decode_chunk_limit
from .inputs import ProcessedPrompt
from .lookahead import Lookahead
from .metrics import LatencyWindow, StepMetrics, count_computed, engine_counters
from .output_processor import OutputProcessor
from .params import FinishReason, RequestOutput, SamplingParams
from .prompts import Prompt, processed_prompt, prompt_batch, run_to_completion
from .request_checks import check_request
from .runner_api import Runner, SeqChunk, StepBatch
from .runner_sampling import Rows, RunnerSampling, plan_runner_sampling, sampled_rows
from .sampling import Drawn, SampleResult, SamplingRows, apply_bitmask_rows, apply_penalties, sample
from .scheduler import ScheduledChunk, Scheduler
from .sequence import SeqStatus, Sequence
from .speculative import SpeculativeConfig, Speculator
from .structured import GrammarError, StructuredOutput, is_constrained


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
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        """`tokenizer`: gpu_engine.tokenizer.Tokenizer (decode + tokenizer.json for grammars); `prepare`: messages ->
        ProcessedPrompt (the processor; None = token-id / ProcessedPrompt prompts only); `model_max_len`: the
        model's own context limit (max_position_embeddings), a cap on top of EngineConfig.max_model_len;
        `speculative`: drafts per step and the cost rule (gpu_engine/speculative/)."""
        self.config = resolve_batching(config or EngineConfig(), runner)  # AUTO batch sizes -> the runner's
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_fingerprint = model_fingerprint
        self._prepare = prepare
        eos = eos_token_ids if eos_token_ids is not None else tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(int(t) for t in eos)

        cfg = self.config
        sizing = size_cache(cfg, int(runner.kv_bytes_per_block(block_size=cfg.block_size)),
                            int(runner.state_bytes_per_slot()), model_max_len, budget=cache_budget(cfg, runner))
        self.cache_bytes = sizing.cache_bytes
        runner.allocate_cache(sizing.spec)
        self.max_model_len = sizing.max_model_len

        self.blocks = BlockManager(
            num_blocks=sizing.num_kv_blocks,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            num_state_slots=sizing.num_state_slots,
            enable_prefix_caching=cfg.enable_prefix_caching,
            has_linear_state=sizing.state_bytes_per_slot > 0,
            copy_state_slot=runner.copy_state_slot,
        )
        encoder_bytes = cfg.encoder_cache_bytes
        if encoder_bytes is None:
            encoder_bytes = default_encoder_budget(runner)
        batch = getattr(runner, "encode_vision_batch", None) if getattr(runner, "batches_vision", False) else None
        self.encoder = EncoderCache(encoder_bytes, runner.encode_vision, runner.embedding_nbytes, batch)
        self.scheduler = Scheduler(cfg, self.blocks, self.encoder, decode_chunk_limit(runner))
        self.outputs = OutputProcessor(tokenizer, vocab_size)
        self.isolation = FailureIsolation(runner, vocab_size)
        self._structured: StructuredOutput | None = None

        self._live: dict[str, Sequence] = {}
        self._with_deadline: dict[str, Sequence] = {}  # live requests with a timeout_s
        self._pending: list[RequestOutput] = []  # finished outside step() (abort): delivered by the next step()
        self._seq_ids = itertools.count()
        self._seed_rng = np.random.default_rng(cfg.seed)
        self._counters = engine_counters()
        self.spec = Speculator(speculative or SpeculativeConfig(), runner, self._counters)
        self.lookahead = Lookahead(self)  # the step in flight on runners that launch steps (lookahead.py)
        self._metrics = StepMetrics()
        self._latencies = LatencyWindow()  # time to first token and latency of the most recent finished requests
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
        speculative: SpeculativeConfig | None = None,
        quantize: str | None = None,
        kv_cache_dtype: str = "auto",
    ) -> Engine:
        """`cuda_options`: settings of the cuda runner; `quantize`: None or "fp8"; `kv_cache_dtype`: "auto" or
        "fp8_e4m3" (reference runner only; see gpu_engine.model.load). Built by gpu_engine/pretrained.py."""
        from .pretrained import engine_from_pretrained

        return engine_from_pretrained(cls, folder, runner, config, expected_digests=expected_digests,
                                      cuda_options=cuda_options, speculative=speculative, quantize=quantize,
                                      kv_cache_dtype=kv_cache_dtype)

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
        check_request(processed, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                      max_logprobs=self.config.max_logprobs, encoder_cache_bytes=self.encoder.budget_bytes,
                      item_bytes=self.encoder.item_bytes)
        if problem := self.spec.problem(params):
            raise RequestError(problem)
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
        if params.lookup_text:
            seq.lookup_ids = np.asarray(self.tokenizer.encode(params.lookup_text, add_special_tokens=False), np.int64)
        self.outputs.start(seq)
        if matcher is not None and self.config.enable_jump_forward:
            # The grammar may force the first tokens (e.g. '{"name":"'): they are prefilled with the prompt.
            # Capped one short of max_tokens so that the request still has a token to sample.
            for token in StructuredOutput.forced_tokens(matcher, seq.remaining_tokens - 1):
                self._counters["forced_tokens"] += 1
                self.outputs.append(seq, token, forced=True)
        self._live[request_id] = seq
        if seq.deadline is not None:
            self._with_deadline[request_id] = seq
        self.scheduler.add(seq)
        self._counters["requests_added"] += 1
        return request_id

    def prepare_prompt(self, prompt: Prompt) -> ProcessedPrompt:
        """Messages / token ids -> ProcessedPrompt (chat template, media decoding). Touches no engine state, so
        front ends may call it on their own threads (AsyncEngine does: media decoding never stalls the step loop)."""
        return processed_prompt(prompt, self._prepare)

    def abort(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes with the next step(). False if unknown."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self._pending.append(self._finish(seq, "abort"))
        return True

    def has_unfinished(self) -> bool:
        # a step still in flight holds rows of live requests only while they are live: those count already
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
            for seq in [s for s in self._with_deadline.values() if s.deadline is not None and now > s.deadline]:
                outputs.append(self._finish(seq, "error", f"timed out after {seq.params.timeout_s} s"))
        if self.lookahead.in_flight is not None:  # its tokens come in now; the next decode step may go first
            delivered, launched = self.lookahead.advance()
            outputs.extend(delivered)
            if launched:
                return self._stepped(outputs, t0)

        self.spec.propose(self.scheduler.running, self.blocks)
        sched = self.scheduler.schedule()
        chunks: list[SeqChunk] = []
        scheduled: list[ScheduledChunk] = []
        # Decode positions for the whole step in one array (one numpy call instead of one per sequence).
        decode_pos = np.array(
            [sc.start + sc.seq.prompt.rope_delta if sc.is_decode else 0 for sc in sched.chunks], dtype=np.int64
        )
        decode_pos = np.broadcast_to(decode_pos, (3, decode_pos.shape[0])).copy()
        self.encoder.prefetch([item for sc in sched.chunks for item in sc.vision_items])  # same-grid items together
        for k, sc in enumerate(sched.chunks):
            try:
                vision = self.encoder.slices(sc.vision_items, sc.start, sc.end) if sc.vision_items else []
            except Exception as exc:  # one bad image must not stop the batch
                outputs.append(self._finish(sc.seq, "error", f"vision encoding failed: {exc}"))
                continue
            seq = sc.seq
            window = self.spec.is_window(sc)
            chunks.append(SeqChunk(
                seq_id=seq.seq_id,
                token_ids=seq.token_slice(sc.start, sc.end),
                positions=decode_pos[:, k : k + 1] if sc.is_decode
                else seq.positions(sc.start, sc.num_tokens),
                start=sc.start,
                block_table=seq.block_table_array(),
                state_slot=seq.slot_in_use(),
                vision=vision,
                logits="all" if window else "last" if sc.wants_logits else "none",
                verify=window, keep_hidden=self.spec.uses_mtp(seq),
            ))
            scheduled.append(sc)
        self.encoder.release()
        if chunks:
            self._metrics.peak_tokens = max(self._metrics.peak_tokens, sum(sc.num_tokens for sc in scheduled))
            if any(c.vision for c in chunks):
                vision_rows = sum(int(v.embeddings.shape[0]) for c in chunks for v in c.vision)
                self._metrics.peak_vision_rows = max(self._metrics.peak_vision_rows, vision_rows)
            launch = self.lookahead.can_launch(chunks, scheduled)  # its tokens then come with the next step()
            # verify windows pick their tokens on the host (speculative/verify.py)
            plan = None if launch or any(c.verify for c in chunks) else self._runner_sampling(scheduled)
            tf = time.perf_counter()
            failed = False
            try:
                if launch:
                    self.lookahead.launch(chunks, scheduled)
                else:
                    result = self.runner.forward(StepBatch(chunks, sampling=plan.request if plan else None))
                    rows: Rows = result.logits if plan is None else sampled_rows(self.runner.name, result)
                    offsets = result.row_offsets
            except Exception as exc:
                scheduled, rows, offsets = self._recover(chunks, scheduled, exc, outputs, plan)
                failed = True  # the re-runs left no hidden states for the MTP head: it sees these positions never
                launch = False
            self._metrics.forward_s += time.perf_counter() - tf
            if launch:
                self.lookahead.plan_launched()  # uniforms and bitmasks while the layers run
            elif scheduled:
                outputs.extend(self._after_forward(scheduled, rows, offsets, plan))
                if not failed and self.spec.has_mtp:
                    self.spec.run_mtp(scheduled)
        self.spec.end_step(self.scheduler.running)
        return self._stepped(outputs, t0)

    def _stepped(self, outputs: list[RequestOutput], t0: float) -> list[RequestOutput]:
        self._counters["steps"] += 1
        self._metrics.add(time.perf_counter() - t0)
        return outputs

    def _runner_sampling(self, scheduled: list[ScheduledChunk]) -> RunnerSampling | None:
        """The step's SamplingRequest when the runner samples (runner_sampling.py), else None (host path)."""
        if not getattr(self.runner, "samples_on_device", False):
            return None
        plan = plan_runner_sampling(scheduled, self._rng, lambda: self.structured, self.vocab_size)
        if plan is not None:
            self._metrics.mask_s += plan.mask_s
        return plan

    def _rng(self, seq: Sequence) -> Any:
        """`seq`'s own Generator, or a stand-in returning the uniform drawn for it and left unused (consumed)."""
        u = self._unused_uniform.pop(seq.seq_id, None)
        return seq.rng if u is None else Drawn(u)

    def _recover(
        self, chunks: list[SeqChunk], scheduled: list[ScheduledChunk], error: Exception, outputs: list[RequestOutput],
        plan: RunnerSampling | None,
    ) -> tuple[list[ScheduledChunk], Rows, list[int]]:
        """The step's forward raised: locate the failing request(s) (FailureIsolation), end them with the error,
        preempt the survivors whose state the failed forward may have touched; returns what the rest keeps. A failed
        verify window is retried without drafts first (Speculator.retry_failed_windows)."""
        found = self.isolation.isolate(chunks, scheduled, error, plan, stateful=self.blocks.has_linear_state)
        self._counters["forward_failures"] += 1
        self._counters["isolation_forwards"] += found.forwards
        failed, retry = self.spec.retry_failed_windows(found.failed)
        for sc, exc in failed:
            self._counters["requests_failed_by_runner"] += 1
            outputs.append(self._finish(sc.seq, "error", f"runner failed: {type(exc).__name__}: {exc}"))
        self._unused_uniform.update(found.unused_uniform)
        for seq in reversed(found.tainted + retry):  # reversed: the oldest ends up first in the waiting queue
            self.scheduler.preempt(seq)
        self._counters["preempted_after_failure"] += len(found.tainted)
        return found.kept, found.rows, found.offsets

    def _after_forward(self, scheduled: list[ScheduledChunk], logits: Rows, offsets: list[int],
                       plan: RunnerSampling | None = None) -> list[RequestOutput]:
        to_sample: list[tuple[Sequence, int]] = []
        windows: list[tuple[ScheduledChunk, int]] = []
        for i, sc in enumerate(scheduled):
            seq = sc.seq
            if self.spec.is_window(sc):
                windows.append((sc, offsets[i]))
                continue
            count_computed(self._counters, sc)
            seq.num_computed = sc.end
            self.blocks.chunk_computed(seq, sc.num_tokens)
            if sc.wants_logits:
                to_sample.append((seq, offsets[i]))
        outputs = self._sample_rows(to_sample, logits, plan) if to_sample else []
        for sc, row in windows:  # after the plain rows: a window may free blocks (rejected drafts)
            assert isinstance(logits, np.ndarray), "a step with verify windows is never sampled on the runner"
            outputs.append(self.spec.verify(sc, logits, row, self.blocks, self._accept, self._finish,
                                            lambda: self.structured))
        return outputs

    def _sample_rows(self, to_sample: list[tuple[Sequence, int]], logits: Rows,
                     plan: RunnerSampling | None) -> list[RequestOutput]:
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
            self._metrics.mask_s += time.perf_counter() - tm
        ts = time.perf_counter()
        # after a failed runner-sampled step some sequences have a uniform already drawn
        rngs: list[Any] = [self._rng(s) for s in seqs] if self._unused_uniform else [s.rng for s in seqs]
        result = sample(logits, rows, rngs)
        self._metrics.sample_s += time.perf_counter() - ts
        return self._deliver(seqs, result.token_ids.tolist(), result.logprobs.tolist(), result.top, dead)

    def _deliver(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float],
                 top: list[list[tuple[int, float]]], dead: list[Sequence]) -> list[RequestOutput]:
        """Sampled tokens (host or runner) -> appended, grammar advanced, stop conditions checked, outputs."""
        outputs = []
        self._counters["sampled_tokens"] += len(seqs) - (sum(s in dead for s in seqs) if dead else 0)
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
        reason = self.outputs.append(seq, token, logprob=logprob, top=top)
        matcher = seq.matcher
        if reason is None and matcher is not None:
            if not matcher.consume_token(token):
                return self._finish(seq, "error", f"structured output failed: {matcher.get_error()}")
            if matcher.is_stopped():
                reason = "stop"
            elif self.config.enable_jump_forward:
                forced_run = StructuredOutput.forced_tokens(matcher, seq.remaining_tokens)
                for forced in forced_run:
                    self._counters["forced_tokens"] += 1
                    reason = self.outputs.append(seq, forced, forced=True)
                    if reason is not None:
                        break
                if forced_run and reason is None and matcher.is_stopped():  # it was not before the forced run
                    reason = "stop"
        if reason is not None:
            return self._finish(seq, reason)
        return self.outputs.output(seq)

    # ------------------------------------------------------------------------------------------ outputs
    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> RequestOutput:
        self.outputs.finish_text(seq)
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.monotonic()
        if seq.first_token_time is not None and reason in ("stop", "length"):
            self._latencies.add(seq.first_token_time - seq.arrival_time, seq.finish_time - seq.arrival_time)
        self._live.pop(seq.request_id, None)
        self._with_deadline.pop(seq.request_id, None)
        self._unused_uniform.pop(seq.seq_id, None)
        self._counters["requests_finished"] += 1
        self._counters[f"finished_{reason}"] += 1
        return self.outputs.output(seq)

    # ------------------------------------------------------------------------------------------ batch helper
    def generate(
        self, prompts: SequenceABC[Prompt] | Prompt, params: SamplingParams | SequenceABC[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts to completion (together, continuously batched); final outputs in the order given.

        A request that fails while running comes back with finish_reason "error"; a request that is rejected up
        front raises RequestError (none of the prompts is then left queued)."""
        ids: list[str] = []
        try:
            for prompt, p in prompt_batch(prompts, params):
                ids.append(self.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        return run_to_completion(self.step, ids)

    # ------------------------------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._counters)
        out.update(self.blocks.stats())
        out.update(self.encoder.stats())
        out.update({
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.num_preemptions,
            "cache_bytes": self.cache_bytes,
            "max_model_len": self.max_model_len,
            **self._metrics.step_times(),
            **self._latencies.percentiles(),
            **self._metrics.work(),
            **self.spec.stats(),
            "model_fingerprint": self.model_fingerprint,
        })
        return out

