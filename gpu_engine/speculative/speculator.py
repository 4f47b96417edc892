"""Speculator: the engine's side of speculative decoding — per request the drafter, per step the cost rule, the
drafts written after each sequence's real tokens (the scheduler only counts them), and after the forward the
verification of each window, the rollback of the rest (linear-attention state, KV blocks) and the MTP head's run.

Drafters (`SamplingParams.speculative`): "ngram" is prompt lookup (prompt, output so far, and the request's
lookup_text); "mtp" is the checkpoint's MTP head, run by the runner after each step; "auto" (the default) takes a
prompt-lookup match when there is one and the MTP head's drafts otherwise (when the runner has one), and obeys the
cost rule (config.py): `auto` drafts only with the tokens a step has left under max_step_tokens after one per
decoding sequence (on runners that sample on the device, only in steps where every decoding sequence could carry a
full window: auto_room; past it the step is the plain decode path), and an `auto` sequence whose attempts gain
nothing rests from drafting for longer and longer (backoff.py: measured at saturation, rejected drafts cost more
than they save). "off" never drafts. Runners
without verify (runner_api.py: supports_verify) run every request without speculation; a request that names a
drafter such a runner cannot serve is refused at add_request.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..cache import BlockManager
from ..params import RequestOutput, SamplingParams
from ..runner_api import MtpDraftRequest
from ..scheduler import ScheduledChunk
from ..sequence import SeqStatus, Sequence
from .backoff import AutoBackoff
from .config import METHODS, SpeculativeConfig
from .drafters import Auto, Drafter, MtpHead, PromptLookup
from .verify import Accept, Finish, verify_window

NAMED = ("ngram", "mtp")  # drafters a request names: they draft as asked, outside auto's cost rule and backoff


def spec_counters() -> dict[str, int]:
    return {
        "spec_verify_windows": 0,  # verify windows run (one per sequence per speculative step)
        "spec_draft_tokens": 0,  # drafts verified
        "spec_accepted_tokens": 0,  # drafts accepted
        "spec_rejected_tokens": 0,  # drafts rejected (their KV freed, linear state rolled back)
        "spec_auto_off_steps": 0,  # steps where the cost rule left an `auto` sequence without drafts
        "spec_grammar_cut_tokens": 0,  # drafts cut before verification because the grammar refused them
        "mtp_head_runs": 0,  # MTP head calls (KV fill + chained drafts)
        "spec_window_retries": 0,  # requests retried without drafts after their verify window failed in the runner
        "spec_room_cut_windows": 0,  # sequences left without drafts: the runner had no room for more windows a step
        "spec_auto_rest_skips": 0,  # `auto` sequences not drafting this step: their last attempts gained nothing
    }


class Speculator:
    def __init__(self, config: SpeculativeConfig, runner: Any, counters: dict[str, int]) -> None:
        self.config = config
        self.runner = runner
        self.can_verify = config.enabled and bool(getattr(runner, "supports_verify", False))
        self.has_mtp = self.can_verify and bool(getattr(runner, "mtp_head", False))
        # a runner may keep its MTP head for speculative="mtp" alone (runner_api: mtp_in_auto)
        self.mtp_in_auto = self.has_mtp and bool(getattr(runner, "mtp_in_auto", True))
        self.counters = counters
        counters.update(spec_counters())
        lookup = PromptLookup(config)
        mtp = MtpHead() if self.has_mtp else None
        self.drafters: dict[str, Drafter] = {"ngram": lookup, "auto": Auto(lookup, mtp if self.mtp_in_auto else None)}
        if mtp is not None:
            self.drafters["mtp"] = mtp
        self.override: Drafter | None = None  # benchmarks / tests: one drafter for every speculating request
        self.backoff = AutoBackoff()
        # A runner may measure a tighter cost rule than the engine's (runner_api: spec_max_step_tokens)
        declared = getattr(runner, "spec_max_step_tokens", None)
        self.max_step_tokens = min(config.max_step_tokens, int(declared)) if declared else config.max_step_tokens

    # ---- requests ----
    def problem(self, params: SamplingParams) -> str | None:
        """Why this engine cannot serve the request's choice of drafter, or None."""
        method = params.speculative
        if method not in METHODS:
            return f"speculative must be one of {', '.join(METHODS)}, got {method!r}"
        if method in ("ngram", "mtp") and not self.can_verify:
            why = ("speculative decoding is off in this engine (SpeculativeConfig.num_tokens=0)"
                   if not self.config.enabled else f"runner {self.runner.name!r} cannot verify drafts yet")
            return f"speculative={method!r}: {why}; use 'auto' or 'off'"
        if method == "mtp" and not self.has_mtp:
            return "speculative='mtp': this checkpoint / runner has no MTP head; use 'ngram', 'auto' or 'off'"
        return None

    def uses_mtp(self, seq: Sequence) -> bool:
        method = seq.params.speculative
        return self.has_mtp and seq.speculate and (method == "mtp" or (method == "auto" and self.mtp_in_auto))

    def head_in_use(self, seqs: Iterable[Sequence]) -> bool:
        """Whether one of `seqs` uses the MTP head ("mtp", or "auto" where the runner lets auto use it): the head
        must see every position of such a sequence (keep_hidden rows, run_mtp after the step) to fill its own KV,
        also in steps where it drafts nothing, so a lookahead step (which gives it neither) must not run it."""
        return self.has_mtp and any(self.uses_mtp(s) for s in seqs)

    def may_draft(self, running: list[Sequence]) -> bool:
        """Whether propose() could give some running sequence drafts this step (when not, a lookahead step, which
        never drafts, loses nothing): `auto` only with room under the cost rule, `ngram` / `mtp` always."""
        if not self.can_verify:
            return False
        room = self.auto_room(len(running)) > 0
        return any(s.speculate and s.params.speculative != "off" and (room or s.params.speculative != "auto")
                   for s in running)

    def drafts_per_window(self) -> int:
        """k: SpeculativeConfig.num_tokens, at most the runner's longest window less one (max_verify_drafts)."""
        longest = getattr(self.runner, "max_verify_drafts", None)
        return self.config.num_tokens if longest is None else min(self.config.num_tokens, int(longest))

    def auto_room(self, decoding: int) -> int:
        """Draft tokens `auto` sequences may take in a step of `decoding` decode rows (the cost rule): what the rows
        leave under max_step_tokens, or 0 — `auto` off, the plain decode path. On a runner that samples on the
        device one verify window takes the whole step off it (every row's logits go to the host, no lookahead
        launch: engine.step), a cost that grows with the batch, not with the drafts; so there `auto` drafts only
        in steps where every decode row could carry a full window: decoding * (1 + k) <= max_step_tokens."""
        if getattr(self.runner, "samples_on_device", False) and decoding * (1 + self.drafts_per_window()) > \
                self.max_step_tokens:
            return 0
        return max(self.max_step_tokens - decoding, 0)

    # ---- before scheduling ----
    def propose(self, running: list[Sequence], blocks: BlockManager) -> None:
        """Write this step's drafts after the real tokens of the running sequences that decode."""
        if not self.can_verify:
            return
        self.backoff.new_step()
        k = self.drafts_per_window()
        decoding = [s for s in running if s.status is SeqStatus.RUNNING and s.num_uncomputed == 1
                    and s.num_computed >= s.prompt_len]
        # The cost rule: `auto` drafts only with the tokens the step has left under max_step_tokens.
        room = self.auto_room(len(decoding))
        if room == 0:  # `auto` is off this step: only named drafters draft, nothing is looked up for the others
            if any(s.params.speculative == "auto" for s in decoding):
                self.counters["spec_auto_off_steps"] += 1
            decoding = [s for s in decoding if s.params.speculative in NAMED]
            if not decoding:
                return
        cut = False
        free = blocks.num_free_blocks
        # A runner may hold rollback state for a limited number of windows a step (CudaRunner.verify_room)
        windows = getattr(self.runner, "verify_room", None)
        window_room = int(windows()) if callable(windows) else len(decoding)
        for seq in decoding:
            method = seq.params.speculative
            if method == "off" or not seq.speculate or seq.remaining_tokens <= 1:
                continue
            if window_room <= 0:
                self.counters["spec_room_cut_windows"] += 1
                continue
            auto = method == "auto"
            if auto and self.backoff.resting(seq.seq_id):
                self.counters["spec_auto_rest_skips"] += 1
                continue
            want = k if not auto else min(k, max(room, 0))
            if want == 0:
                cut = True
                continue
            drafts = (self.override or self.drafters[method]).propose(seq, want)
            if drafts and seq.matcher is not None:
                ok = int(seq.matcher.validate_tokens(drafts))  # drafts the grammar refuses are never verified
                self.counters["spec_grammar_cut_tokens"] += len(drafts) - ok
                drafts = drafts[:ok]
            if not drafts:
                if auto:
                    self.backoff.record(seq.seq_id, gained=False)
                continue
            extra = blocks.blocks_needed(seq, 1 + len(drafts)) - blocks.blocks_needed(seq, 1)
            if extra > free:  # drafts never take blocks that would force a preemption
                continue
            free -= extra
            seq.set_drafts(drafts)
            room -= seq.num_drafts
            window_room -= 1
        if cut:
            self.counters["spec_auto_off_steps"] += 1

    # ---- the step's chunks ----
    @staticmethod
    def is_window(sc: ScheduledChunk) -> bool:
        """The chunk runs drafts: the last real token then drafts (drafts are only written for decoding sequences)."""
        return sc.end > sc.seq.num_tokens

    def retry_failed_windows(self, failed: list[tuple[ScheduledChunk, Exception]]
                             ) -> tuple[list[tuple[ScheduledChunk, Exception]], list[Sequence]]:
        """The forward failed for these chunks (failure_isolation.py). A verify window may have failed for one of its
        drafts, which are no real tokens: such a request is retried without drafts (speculation off for the rest of
        it, so drafts cannot fail it twice) and ends with the runner's error only if the plain retry fails too.
        Returns (the failures that end their request, the sequences to preempt for the retry: the failed forward may
        have half-written their linear-attention state)."""
        end: list[tuple[ScheduledChunk, Exception]] = []
        retry: list[Sequence] = []
        for sc, exc in failed:
            if self.is_window(sc) and sc.seq.speculate:
                sc.seq.speculate = False
                sc.seq.num_drafts = 0
                retry.append(sc.seq)
            else:
                end.append((sc, exc))
        self.counters["spec_window_retries"] += len(retry)
        return end, retry

    # ---- after the forward ----
    def verify(self, sc: ScheduledChunk, logits: np.ndarray, first_row: int, blocks: BlockManager, accept: Accept,
               finish: Finish, structured: Callable[[], Any]) -> RequestOutput:
        """Verify one window (rows first_row ... of `logits`, one per chunk token) and roll the rest back."""
        seq = sc.seq
        base = seq.num_tokens  # position of the first draft
        drafts = seq.drafts()[:sc.end - base]  # a budget-cut chunk verifies the drafts it holds
        seq.num_drafts = 0
        last = first_row + (base - 1 - sc.start)
        result = verify_window(seq, logits[last:last + len(drafts) + 1], drafts, accept, finish, structured)
        self.counters["spec_verify_windows"] += 1
        self.counters["decode_tokens"] += 1 + result.accepted  # the window's tokens that stay: decode throughput
        self.counters["sampled_tokens"] += result.chosen
        self.counters["spec_draft_tokens"] += len(drafts)
        self.counters["spec_accepted_tokens"] += result.accepted
        self.counters["spec_rejected_tokens"] += len(drafts) - result.accepted
        seq.verify_steps += 1
        seq.draft_tokens += len(drafts)
        seq.accepted_draft_tokens += result.accepted
        if seq.params.speculative == "auto":
            self.backoff.record(seq.seq_id, gained=result.accepted > 0)
        if seq.status is SeqStatus.RUNNING:
            seq.num_computed = base + result.accepted  # the last real token and the accepted drafts
            if seq.num_computed < sc.end:
                self.runner.rollback_state(seq.slot_in_use(), seq.num_computed - sc.start)
            blocks.trim(seq)
            blocks.commit(seq)
        return result.output

    def run_mtp(self, scheduled: list[ScheduledChunk]) -> None:
        """After a step: the MTP head sees every position of the MTP sequences that is now final (its KV), and
        drafts for the sequences that decode next."""
        requests, seqs = [], []
        k = self.config.num_tokens
        for sc in scheduled:
            seq = sc.seq
            seq.mtp_drafts = []
            if not self.uses_mtp(seq) or seq.status is not SeqStatus.RUNNING:
                continue
            # A prompt chunk's last position waits for the next chunk (its next token may be an image row); the
            # runner keeps that one row (runner_api.MtpDraftRequest).
            start = sc.start - 1 if sc.start > 0 and seq.mtp_next == sc.start - 1 else sc.start
            in_prompt = seq.num_computed < seq.prompt_len
            end = seq.num_computed - 1 if in_prompt else seq.num_computed
            seq.mtp_next = end
            n = end - start
            if n < 1 or seq.num_tokens <= end:
                continue
            drafts = k if seq.num_uncomputed == 1 and not in_prompt else 0
            requests.append(MtpDraftRequest(
                seq_id=seq.seq_id, start=start, next_tokens=seq.token_ids[start + 1:start + 1 + n].copy(),
                positions=seq.positions(start, n + max(0, drafts - 1)), block_table=seq.block_table_array(),
                num_drafts=drafts))
            seqs.append(seq)
        if not requests:
            return
        self.counters["mtp_head_runs"] += len(requests)
        for seq, drafts in zip(seqs, self.runner.mtp_draft(requests)):
            seq.mtp_drafts = list(drafts)

    def end_step(self, running: list[Sequence]) -> None:
        """Drafts live for one step: those of sequences that were not scheduled go (none are written where the
        runner cannot verify, so the hot path of such runners skips the loop)."""
        if not self.can_verify:
            return
        for seq in running:
            seq.num_drafts = 0
        if self.backoff.tracking:
            self.backoff.forget_all_but({seq.seq_id for seq in running})

    def stats(self) -> dict[str, float]:
        c = self.counters
        drafted, windows = c["spec_draft_tokens"], c["spec_verify_windows"]
        return {
            "spec_acceptance_rate": c["spec_accepted_tokens"] / drafted if drafted else 0.0,
            # tokens a verify window adds on average: the accepted drafts plus the target's own token
            "spec_mean_accepted_length": (c["spec_accepted_tokens"] + windows) / windows if windows else 0.0,
        }
