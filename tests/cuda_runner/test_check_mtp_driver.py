"""check_mtp's driver on the CPU: the Tee runner (two reference runners standing in for CUDA and reference) counts
equal drafts over an engine run whose greedy output is plain decoding's, and a head with other weights on one side
shows up as unequal drafts."""
from __future__ import annotations

from pathlib import Path

import numpy as np

import gpu_engine
from gpu_engine.loader import ModelWeights
from gpu_engine.params import SamplingParams
from gpu_engine.reference.mtp import random_mtp_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.tiny import make_tiny_checkpoint
from tests.cuda_runner import check_mtp as cm


def test_the_tee_compares_drafts_and_the_output_stays_plain(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=5)
    loaded = gpu_engine.load(folder)
    w = loaded.runner.weights
    cfg = loaded.config

    def runner(seed: int) -> ReferenceRunner:
        return ReferenceRunner(cfg, ModelWeights(w.text, w.vision, w.lm_head, mtp=random_mtp_weights(cfg.text, seed)))

    ids = cm.prompts(np.random.default_rng(0), cfg.text.vocab_size, count=3)
    params = SamplingParams(max_tokens=cm.MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2,
                            speculative="mtp")
    plain = cm.run(cm.engine_for(runner(3), loaded, folder, 0), ids,
                   SamplingParams(max_tokens=cm.MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2,
                                  speculative="off"))
    tee = cm.Tee(runner(3), runner(3))
    got = cm.run(cm.engine_for(tee, loaded, folder, cm.K), ids, params)
    assert cm.compare(plain, got)[0]
    assert tee.compared > 20 and tee.equal == tee.compared and tee.first_diff == ""
    other = cm.Tee(runner(4), runner(3))
    cm.run(cm.engine_for(other, loaded, folder, cm.K), ids, params)
    assert other.equal < other.compared and "cuda" in other.first_diff
    row = cm.MtpResult("tiny", "f32", "drafts vs reference", tee.compared, 1.0, True, True)
    assert "PASS" in cm.format_table([row])
