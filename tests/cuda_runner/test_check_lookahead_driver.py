"""check_lookahead's driver on the CPU (reference runner with runner sampling and launches switched on): its cases
run through both engines, agree token for token, give valid JSON, and the lookahead engine takes lookahead steps
with discarded rows where grammars force runs — what the GPU check then asks of the CUDA runner."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
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
    assert cl.compare(plain, got)[0]
    assert case != "json" or (cl.valid_json(plain) and cl.valid_json(got))
    stats = eng.stats()
    assert stats["lookahead_steps"] > 0 and stats["lookahead_failures"] == 0, eng.lookahead.off_reason
    assert case != "prefill" or (stats["lookahead_prefill_steps"] > 0 and stats["prefix_hit_requests"] > 0)
    assert case != "json" or stats["lookahead_discarded_rows"] > 0  # forced runs after fed tokens
