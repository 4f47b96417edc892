"""check_lookahead's driver on the CPU (reference runner with runner sampling and launches switched on): its cases
run through both engines, agree token for token, give valid JSON, and the lookahead engine takes lookahead steps
with discarded rows where grammars force runs — what the GPU check then asks of the CUDA runner. And its noise
rule: the teacher-forced reference replays the engine's logprobs (grammar masks included), a flip that the noise
explains passes (a greedy near tie, a sampled row's uniform at a CDF edge), a token the noise cannot explain fails."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import RequestOutput, SamplingParams, TokenLogprob
from gpu_engine.tiny import make_tiny_checkpoint
from tests.cuda_runner import check_lookahead as cl


def reference_engine(folder: Path, lookahead: bool, case: str) -> Engine:
    budget = {"max_batched_tokens": cl.PREFILL_BUDGET} if case == "prefill" else {}
    config = EngineConfig(max_num_seqs=cl.MAX_NUM_SEQS, block_size=4, **budget)
    eng = Engine.from_pretrained(folder, config=config)
    eng.runner.samples_on_device = True
    eng.runner.supports_lookahead = eng.lookahead.enabled = lookahead
    return eng


@pytest.mark.parametrize("case", cl.CASES)
def test_the_cases_agree_and_exercise_lookahead_on_the_reference_runner(tmp_path: Path, case: str) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=5)
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    params = cl.case_params(case, rng)
    ids = cl.case_prompts(case, rng)
    plain = cl.run(reference_engine(folder, False, case), ids, params)
    eng = reference_engine(folder, True, case)
    got = cl.run(eng, ids, params)
    assert [plain[r].token_ids for r in plain] == [got[r].token_ids for r in plain]
    same, explained, note, noise, got_noise = cl.judge_run(folder, "f32", eng.structured, ids, params, plain, got)
    assert (same, explained, note) == (True, False, "")
    # one chunk, teacher-forced, masks replayed: the engine's own logprobs, step by step, to float32 rounding
    assert noise < 1e-4 and got_noise < 1e-4
    assert case != "json" or (cl.valid_json(plain) and cl.valid_json(got))
    stats = eng.stats()
    assert stats["lookahead_steps"] > 0 and stats["lookahead_failures"] == 0, eng.lookahead.off_reason
    assert case != "prefill" or (stats["lookahead_prefill_steps"] > 0 and stats["prefix_hit_requests"] > 0)
    assert case != "json" or stats["lookahead_discarded_rows"] > 0  # forced runs after fed tokens


def output(tokens: list[int], forced: tuple[int, ...] = ()) -> RequestOutput:
    lps = [TokenLogprob(t, "", 0.0, [(t, 0.0)]) if k in forced else TokenLogprob(t, "", -1.0, [(t, -1.0), (0, -2.0)])
           for k, t in enumerate(tokens)]
    return RequestOutput(request_id="r0", text="", token_ids=tokens, finished=True, logprobs=lps)


def judged(plain: list[int], got: list[int], ref: np.ndarray, params: SamplingParams, noise: float,
           forced: tuple[int, ...] = ()) -> bool:
    same, explained, _ = cl.judge({"r0": output(plain, forced)}, {"r0": output(got, forced)}, {"r0": ref},
                                  {"r0": params}, noise)
    assert not same
    return explained


def test_a_greedy_flip_passes_within_the_noise_and_a_wrong_token_fails() -> None:
    greedy = SamplingParams(temperature=0.0)
    ref = np.log(np.array([[0.5, 0.5, 1e-9, 1e-9], [0.30, 0.29, 0.01, 0.40]]))  # position 1: 3 and 0 near-tied
    gap = float(ref[1, 3] - ref[1, 0])  # 0.288 nats: no tie by the old 0.05 rule; bf16 noise of 0.026 covers it
    reach = cl.NOISE_SIGMAS * np.sqrt(2.0)  # the difference of two tokens' errors, in noise RMS
    assert judged([0, 3], [0, 0], ref, greedy, noise=gap / reach * 1.01)  # rounding flipped the argmax
    assert not judged([0, 3], [0, 0], ref, greedy, noise=gap / reach * 0.99)
    assert not judged([0, 3], [0, 2], ref, greedy, noise=0.05)  # 3.7 nats below the best: not noise
    assert not judged([0, 3], [0, 3, 1], ref, greedy, noise=0.05)  # one run ran on: not a flip
    assert not judged([0, 3], [0, 1], np.where(np.arange(4) == 1, -np.inf, ref), greedy, noise=1.0)  # forbidden


def test_a_sampled_flip_passes_only_where_its_uniform_sits_at_a_cdf_edge() -> None:
    sampled = SamplingParams(temperature=1.0, seed=7)
    u = cl.uniform_at(sampled, output([5, 5, 5], forced=(1,)), 2)  # position 1 was forced: the second draw
    rng = np.random.default_rng(7)
    assert u == [rng.random() for _ in range(2)][1]
    # tokens 1 and 2 meet 0.002 above u: plain drew 1; with logprob errors of RMS 0.01 that edge moves by
    # ~0.0009 (one standard deviation), so a run may draw 2
    edge = u + 0.002
    probs = np.array([edge / 2, edge / 2, (1 - edge) / 2, (1 - edge) / 2])
    ref = np.log(np.stack([probs, probs, probs]))
    assert judged([5, 5, 1], [5, 5, 2], ref, sampled, noise=0.01, forced=(1,))
    assert not judged([5, 5, 1], [5, 5, 2], ref, sampled, noise=1e-4, forced=(1,))
    assert not judged([5, 5, 1], [5, 5, 3], ref, sampled, noise=0.01, forced=(1,))  # 0.05 from u: not noise
    # the same two tokens with another seed's uniform, far from their edge: what decides is u, not a top-2 gap
    assert not judged([5, 5, 1], [5, 5, 2], ref, SamplingParams(temperature=1.0, seed=8), noise=0.01, forced=(1,))
