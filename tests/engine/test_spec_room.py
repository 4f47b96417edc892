"""A runner that can roll back a limited number of windows a step (CudaRunner.verify_room): the speculator drafts
for no more sequences than that, counts the rest (spec_room_cut_windows), and greedy output stays plain decoding's."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.speculative.drafters import Replay
from gpu_engine.tiny import make_tiny_checkpoint


def test_drafts_go_to_no_more_sequences_than_the_runner_has_room_for(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=6)
    prompts = [np.random.default_rng(i).integers(10, 2000, 9).tolist() for i in range(3)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def run(k: int, room: int | None) -> tuple[dict[str, list[int]], Engine, list[int]]:
        eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=3, block_size=4),
                                     speculative=SpeculativeConfig(num_tokens=k))
        if room is not None:
            eng.runner.verify_room = lambda: room  # type: ignore[attr-defined]
            eng.spec.override = Replay(plain, 0.0, eng.vocab_size)
        for i, p in enumerate(prompts):
            eng.add_request(p, params, request_id=f"r{i}")
        done, windows = {}, []
        while eng.has_unfinished():
            before = eng.stats()["spec_verify_windows"]
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            windows.append(eng.stats()["spec_verify_windows"] - before)
        return done, eng, windows

    plain: dict[str, list[int]] = {}
    plain.update(run(0, None)[0])
    got, eng, windows = run(3, 1)
    assert got == plain
    assert max(windows) == 1 and eng.stats()["spec_room_cut_windows"] > 0


def test_windows_carry_no_more_drafts_than_the_runner_keeps(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", seed=7)
    eng = Engine.from_pretrained(folder, config=EngineConfig(max_num_seqs=2, block_size=4),
                                 speculative=SpeculativeConfig(num_tokens=5))
    eng.runner.max_verify_drafts = 2  # type: ignore[attr-defined]  # as CudaRunner with rollback="window"
    eng.spec.override = Replay({"r0": list(range(100, 140))}, 0.0, eng.vocab_size)
    eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=12, ignore_eos=True), request_id="r0")
    longest = 0
    while eng.has_unfinished():
        eng.spec.propose(eng.scheduler.running, eng.blocks)
        longest = max([longest, *(s.num_drafts for s in eng.scheduler.running)])
        for seq in eng.scheduler.running:
            seq.num_drafts = 0
        eng.step()
    assert longest == 2 and eng.stats()["spec_draft_tokens"] > 0
