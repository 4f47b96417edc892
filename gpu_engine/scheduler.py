"""Continuous batching: which sequences run this step, and how many of their tokens.

Every sequence simply has "uncomputed tokens" (a whole prompt, the rest of a chunked prompt, one decode token, or
a jump-forward run). Each step:
1. running sequences, oldest first, get their next tokens (decode = 1) while the `max_batched_tokens` budget lasts;
   if the cache has no block for one, the most recently admitted running sequence is preempted (its cache is
   dropped and it is recomputed later, keeping every generated token) — possibly the sequence itself;
2. the leftover budget is backfilled with waiting requests in FIFO order (prefix-cache hits skip their cached
   prefix); the last one admitted may get a partial chunk. A head request that does not fit blocks the queue, so
   large requests are never starved by small ones.
A decoding sequence's jump-forward run is cut to the runner's declared decode chunk (forced_runs.py), if any.
Chunks are also cut so that the vision items they overlap fit the encoder-cache budget, and (hybrid models with
prefix caching) so that they end on the block boundaries where linear-attention state snapshots are taken.
With `min_prefill_tokens` set, a step that has decode rows leaves prompt chunks (and admissions) out until that many
prompt tokens are ready, for at most `max_prefill_hold_steps` steps in a row: prompt work comes in fuller steps.
The step after one still in flight (lookahead.py) is scheduled the same way, once the in-flight chunks' cache
bookkeeping is done: a sequence whose sampled token is still in flight gets its next row (one token, fed from that
token), none when the token is its request's last.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from .cache import BlockManager
from .encoder_cache import EncoderCache
from .engine_config import EngineConfig
from .forced_runs import decode_chunk
from .inputs import VisionItem
from .sequence import SeqStatus, Sequence


class ScheduledChunk:
    """One sequence's tokens [start, end) for this step (plain slots class: built for every sequence, every step)."""

    __slots__ = ("seq", "start", "num_tokens", "end", "vision_items", "wants_logits", "is_decode")

    def __init__(self, seq: Sequence, start: int, num_tokens: int, vision_items: list[VisionItem]) -> None:
        self.seq = seq
        self.start = start  # == tokens already in the cache
        self.num_tokens = num_tokens
        self.end = start + num_tokens
        self.vision_items = vision_items
        # Only a chunk that reaches the sequence's last token produces a token to sample (past it: drafts to verify).
        self.wants_logits = self.end >= seq.num_tokens
        # One generated token past the prompt: its positions are start + rope_delta on all three axes.
        self.is_decode = num_tokens == 1 and start >= seq.prompt_len


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, encoder: EncoderCache,
                 decode_chunk_limit: int | None = None) -> None:
        self.config = config
        # The runner's longest decode-phase chunk (forced_runs.py): longer forced runs are spread over steps.
        self.decode_chunk_limit = decode_chunk_limit
        self.num_cut_runs = 0  # decoding chunks cut to that limit (the rest of their run waits for the next step)
        self.blocks = blocks
        self.encoder = encoder
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Snapshots of linear-attention state are only useful (and only taken) on block boundaries.
        self._align = blocks.enable_prefix_caching and blocks.has_linear_state
        self._held = 0  # steps in a row whose prompt chunks were held back (min_prefill_tokens)
        self.num_held_steps = 0

    # ---- queue management ----
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished / aborted / failed sequence out and give back its cache."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's cache and queue it first for recompute (e.g. its state may be corrupt after a
        failed forward)."""
        if seq.status is SeqStatus.RUNNING:
            self._preempt(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self, in_flight: Collection[int] = ()) -> SchedulerOutput:
        """`in_flight`: ids of sequences whose sampled token is in flight (computed up to num_tokens, the token not
        appended yet): each gets the decode row that token is fed to (lookahead.py)."""
        out = SchedulerOutput()
        budget = self.config.max_batched_tokens
        hold = self._hold_prompts()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            fed = seq.seq_id in in_flight
            if fed and seq.remaining_tokens <= 1:
                continue  # the token in flight is the request's last (max_tokens)
            if fed or (seq.num_tokens_with_drafts - seq.num_computed == 1 and seq.num_computed >= seq.prompt_len):
                n = 1  # plain decode (the common case, kept cheap)
                if seq.num_computed % self.config.block_size:  # its block exists already
                    out.chunks.append(ScheduledChunk(seq, seq.num_computed, 1, []))
                    budget -= 1
                    continue
            elif hold and seq.num_computed < seq.prompt_len:
                continue  # its prompt chunk waits for a fuller step
            else:
                n = self._chunk_size(seq, seq.num_computed, budget)
            if n == 0:
                continue
            while not self.blocks.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self._take(out, seq, n)
            budget -= n

        # Admission only when nothing had to be preempted: memory is tight, let the running ones finish first.
        while (not hold and not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hit = self.blocks.match_prefix(seq)
            n = self._chunk_size(seq, hit.num_tokens, budget)
            if n == 0 or not self.blocks.can_admit(seq, hit, n):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, hit)
            if not seq.admitted_once:
                seq.cached_prompt_tokens = hit.num_tokens
                seq.admitted_once = True
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._take(out, seq, n)
            budget -= n
        return out

    def _hold_prompts(self) -> bool:
        """Whether this step leaves prompt chunks and admissions out (min_prefill_tokens): only when some running
        sequence is past its prompt (the step runs anyway), fewer than min_prefill_tokens prompt tokens are ready
        (the rest of running prompts, then waiting ones while free slots last, cached prefixes counted too: an
        estimate) and the prompts have not been held max_prefill_hold_steps steps in a row already."""
        want = min(self.config.min_prefill_tokens, self.config.max_batched_tokens)
        if want == 0:
            return False
        decoding, ready = False, 0
        for seq in self.running:
            if seq.num_computed < seq.prompt_len:
                ready += seq.prompt_len - seq.num_computed
            else:
                decoding = True
        free = self.config.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if ready >= want or free <= 0:
                break
            ready += seq.num_tokens - seq.num_computed
            free -= 1
        if not decoding or ready == 0 or ready >= want or self._held >= self.config.max_prefill_hold_steps:
            self._held = 0
            return False
        self._held += 1
        self.num_held_steps += 1
        return True

    def _take(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        self.blocks.allocate(seq, n)
        start = seq.num_computed
        items = seq.vision_items_in(start, start + n) if start < seq.prompt_len else []
        out.chunks.append(ScheduledChunk(seq, start, n, items))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _chunk_size(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens of `seq` to run from `start` this step (0: cannot advance now)."""
        remaining = seq.num_tokens_with_drafts - start  # speculative drafts count against the token budget
        n = min(remaining, budget)
        if n == 0 or start >= seq.prompt_len:  # decode / jump-forward run: no vision, no snapshot boundary
            cut = decode_chunk(seq, n, self.decode_chunk_limit)
            self.num_cut_runs += cut < n
            return cut
        bs = self.config.block_size
        if self._align:
            if n < remaining and (start + n) // bs * bs > start:
                n = (start + n) // bs * bs - start  # a budget-cut chunk ends on a block boundary
            for b in self._snapshot_boundaries(seq):
                if start < b < start + n:
                    n = b - start
                    break
        items = seq.vision_items_in(start, start + n)
        if items:
            fit = self.encoder.reserve(items)
            if fit < len(items):
                n = max(0, items[fit].token_start - start)
        return n

    def _snapshot_boundaries(self, seq: Sequence) -> list[int]:
        """Block boundaries worth a state snapshot: before the first vision item (same instructions, another
        document), after the last one (same document, another question) and the end of the prompt's last full
        block (the same prompt again)."""
        bs = self.config.block_size
        points = {(seq.prompt_len - 1) // bs * bs}
        if seq.prompt.vision_items:
            points.add(seq.prompt.vision_items[0].token_start // bs * bs)
            points.add(seq.prompt.vision_items[-1].token_end // bs * bs)
        return sorted(p for p in points if p > 0)
