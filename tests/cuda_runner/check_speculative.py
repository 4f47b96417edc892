"""GPU check: speculative decoding on the CUDA runner, greedy outputs against the same runner without speculation.

    python3 -m tests.cuda_runner.check_speculative [--json out.json] [--seed N]

Per tiny random Qwen3.5 checkpoint (check_runner's two configs) and dtype (f32, bf16): the engine on the CUDA
runner without speculation gives each prompt's greedy continuation (with top-2 logprobs); then, per rollback
strategy (CudaOptions.rollback: recompute, window), one engine with k = 3 runs the same prompts with the Replay
drafter at corrupt 0.0 / 0.4 / 1.0 (every draft right, some, none) and with prompt lookup (its lookup_text is
the plain continuation, as a page's text layer holds what is copied from it). Its verify steps replay CUDA
graphs after their first sighting (counted). Pass: token for token the plain output; in bf16 a divergence is
tolerated only at a near tie of the plain run (its top-2 logprob gap < NEAR_TIE: the verify step's GEMMs and
kernels run other shapes than decode steps, so bf16 roundings differ). f32 also against the reference runner's
speculative run (Replay, corrupt 0.4): identical tokens.
Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.params import RequestOutput, SamplingParams
from tests.cuda_runner.check_runner import CONFIGS
from tests.cuda_runner.harness import check_main, fresh_seed

K = 3
MAX_TOKENS = 24
NEAR_TIE = 0.05  # nats between the plain run's top-2 logprobs at a bf16 divergence
DRAFTERS = ("replay-0.0", "replay-0.4", "replay-1.0", "ngram")


@dataclass
class SpecResult:
    config: str
    dtype: str
    rollback: str
    drafter: str
    identical: bool
    near_tie: bool  # diverged, at a near tie of the plain run (tolerated in bf16)
    draft_tokens: int
    accepted_tokens: int
    graphed_steps: int
    ok: bool
    note: str = ""


def prompts(rng: np.random.Generator, vocab: int, count: int = 4) -> list[list[int]]:
    """Random prompts whose second half repeats a span of the first (prompt lookup finds matches)."""
    out = []
    for n in rng.integers(8, 24, count):
        head = rng.integers(3, min(vocab, 2000), int(n)).tolist()
        out.append(head + head[: int(n) // 2])
    return out


def run(engine: Any, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
        ) -> dict[str, RequestOutput]:
    per = params if isinstance(params, list) else [params] * len(prompt_ids)
    for i, (p, sp) in enumerate(zip(prompt_ids, per)):
        engine.add_request(p, sp, request_id=f"r{i}")
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def compare(plain: dict[str, RequestOutput], got: dict[str, RequestOutput]) -> tuple[bool, bool, str]:
    """(identical, every divergence at a near tie of the plain run, note)."""
    ties, notes = True, []
    for rid, ref in plain.items():
        a, b = ref.token_ids, got[rid].token_ids
        if a == b:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gap = float("inf")
        if ref.logprobs is not None and pos < len(ref.logprobs) and len(ref.logprobs[pos].top) >= 2:
            top = ref.logprobs[pos].top
            gap = top[0][1] - top[1][1]
        ties &= gap < NEAR_TIE
        notes.append(f"{rid} diverges at {pos} (plain top-2 gap {gap:.3g})")
    return not notes, ties and bool(notes), "; ".join(notes)[:300]


def drafter_params(name: str, lookup_text: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2,
                          speculative="ngram" if name == "ngram" else "auto", lookup_text=lookup_text)


def run_drafters(engine: Any, prompt_ids: list[list[int]], plain: dict[str, RequestOutput], vocab: int,
                 seed: int) -> list[tuple[str, dict[str, RequestOutput], dict[str, int]]]:
    """Each drafter of DRAFTERS on one speculative engine: (name, outputs, the counters it moved)."""
    from gpu_engine.speculative.drafters import Replay

    recorded = {rid: out.token_ids for rid, out in plain.items()}
    rows = []
    for name in DRAFTERS:
        engine.spec.override = (Replay(recorded, float(name.split("-")[1]), vocab, seed=seed)
                                if name.startswith("replay") else None)
        before = dict(engine.stats())
        if name == "ngram":  # the page's text layer holds the plain continuation: prompt lookup finds it
            params = [drafter_params(name, engine.tokenizer.decode(plain[f"r{i}"].token_ids))
                      for i in range(len(prompt_ids))]
            got = run(engine, prompt_ids, params)
        else:
            got = run(engine, prompt_ids, drafter_params(name))
        after = engine.stats()
        moved = {key: int(after[key] - before.get(key, 0)) for key in ("spec_draft_tokens", "spec_accepted_tokens")}
        rows.append((name, got, moved))
    return rows


def cuda_engine(folder: Path, config: Any, dtype: str, k: int, rollback: str) -> Any:
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.engine import Engine
    from gpu_engine.speculative import SpeculativeConfig

    return Engine.from_pretrained(folder, runner="cuda", config=config, speculative=SpeculativeConfig(num_tokens=k),
                                  cuda_options=CudaOptions(dtype=dtype, memory_budget=1 << 30, rollback=rollback))


def run_all(seed: int | None = None) -> tuple[list[SpecResult], dict]:
    from gpu_engine.cuda.device import require_gpu
    from gpu_engine.engine import Engine
    from gpu_engine.engine_config import EngineConfig
    from gpu_engine.speculative import SpeculativeConfig
    from gpu_engine.tiny import make_tiny_checkpoint

    require_gpu()
    seed = fresh_seed(seed)
    results: list[SpecResult] = []
    config = EngineConfig(max_num_seqs=4, block_size=4)
    plain_params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2,
                                  speculative="off")
    for cname, text_cfg in CONFIGS.items():
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "m"
            make_tiny_checkpoint(folder, seed=seed % 1000, text_config=text_cfg)
            ref = Engine.from_pretrained(folder, runner="reference", config=config,
                                         speculative=SpeculativeConfig(num_tokens=K))
            vocab = ref.vocab_size
            prompt_ids = prompts(np.random.default_rng(seed), vocab)
            ref_plain = run(ref, prompt_ids, plain_params)
            ref_spec = {name: got for name, got, _ in run_drafters(ref, prompt_ids, ref_plain, vocab, seed)}
            for dtype in ("f32", "bf16"):
                base = cuda_engine(folder, config, dtype, 0, "recompute")
                plain = run(base, prompt_ids, plain_params)
                base.runner.close()
                for rollback in ("recompute", "window"):
                    try:
                        eng = cuda_engine(folder, config, dtype, K, rollback)
                        rows = run_drafters(eng, prompt_ids, plain, vocab, seed)
                        graphed = eng.runner.decode_counts.graphed
                        eng.runner.close()
                    except Exception as exc:  # noqa: BLE001 - one broken strategy must not hide the other
                        results.append(SpecResult(cname, dtype, rollback, "all", False, False, 0, 0, 0, False,
                                                  f"{type(exc).__name__}: {exc}"[:300]))
                        continue
                    for name, got, moved in rows:
                        same, tie, note = compare(plain, got)
                        ok = same or (dtype == "bf16" and tie)
                        if dtype == "f32" and name == "replay-0.4":
                            ref_same, _, ref_note = compare(ref_spec[name], got)
                            ok &= ref_same
                            note = (note + ("" if ref_same else f"; vs reference spec: {ref_note}")).strip("; ")
                        results.append(SpecResult(cname, dtype, rollback, name, same, tie,
                                                  moved["spec_draft_tokens"], moved["spec_accepted_tokens"], graphed,
                                                  bool(ok), note))
                        print(format_table(results[-1:]).splitlines()[-1], flush=True)  # progress, if cut short
    return results, {"seed": seed, "k": K, "max_tokens": MAX_TOKENS, "near_tie": NEAR_TIE}


def format_table(results: list[SpecResult]) -> str:
    lines = [f"{'config':<40} {'dtype':<5} {'rollback':<9} {'drafter':<11} {'drafts':>6} {'acc':>5} {'graphed':>7} "
             f"{'greedy':>7}  ok", "-" * 104]
    for r in results:
        greedy = "same" if r.identical else "tie" if r.near_tie else "DIFF"
        lines.append(f"{r.config:<40} {r.dtype:<5} {r.rollback:<9} {r.drafter:<11} {r.draft_tokens:>6} "
                     f"{r.accepted_tokens:>5} {r.graphed_steps:>7} {greedy:>7}  {'PASS' if r.ok else 'FAIL'}"
                     + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())
