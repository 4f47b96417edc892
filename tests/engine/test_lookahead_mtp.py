"""Lookahead decoding on a checkpoint with an MTP head (gpu_engine/lookahead.py, Lookahead.mtp_ahead): the head alone
does not turn lookahead off. Requests with speculation off, and `auto` where the runner keeps the head for "mtp"
requests (CudaOptions.mtp_in_auto off, the CUDA runner's default), launch lookahead steps at any batch; a request
that uses the head ("mtp", or `auto` with mtp_in_auto) runs only plain steps, whose chunks keep their hidden rows
for the head, also when it arrives while steps run ahead. Tokens are the plain path's throughout."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpu_engine
from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.loader import ModelWeights
from gpu_engine.params import SamplingParams
from gpu_engine.reference.mtp import random_mtp_weights
from gpu_engine.reference.runner import ReferenceRunner
from gpu_engine.speculative import SpeculativeConfig
from gpu_engine.tiny import make_tiny_checkpoint
from gpu_engine.tokenizer import Tokenizer

PROMPTS = [np.random.default_rng(6).integers(10, 2000, n).tolist() for n in (9, 21, 14, 11)]
LIMIT = 8  # max_step_tokens: with k = 3, `auto` windows for at most 2 decode rows


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", seed=21)


def engine(folder: Path, *, lookahead: bool = True, mtp_in_auto: bool = True) -> Engine:
    """Reference runner with a random MTP head, sampling on the runner (the CUDA runner's path), k = 3."""
    loaded = gpu_engine.load(folder)
    w = loaded.runner.weights  # type: ignore[attr-defined]
    runner = ReferenceRunner(loaded.config, ModelWeights(w.text, w.vision, w.lm_head,
                                                         mtp=random_mtp_weights(loaded.config.text, seed=3)))
    runner.samples_on_device = runner.supports_lookahead = lookahead  # type: ignore[misc]
    runner.mtp_in_auto = mtp_in_auto  # type: ignore[attr-defined]
    eng = Engine(runner, Tokenizer.from_pretrained(folder), vocab_size=loaded.config.text.vocab_size,
                 config=EngineConfig(max_num_seqs=4, block_size=4),
                 speculative=SpeculativeConfig(num_tokens=3, max_step_tokens=LIMIT), prepare=loaded.prepare)
    assert eng.spec.has_mtp
    eng.lookahead.enabled = lookahead
    return eng


class Spy:
    """The seq ids of every launched chunk, and of every plain-forward chunk without kept hidden rows."""

    def __init__(self, eng: Engine) -> None:
        self.launched: set[int] = set()
        self.not_kept: set[int] = set()
        forward, launch = eng.runner.forward, eng.runner.launch  # type: ignore[attr-defined]

        def spy_forward(batch: Any) -> Any:
            self.not_kept |= {c.seq_id for c in batch.chunks if not c.keep_hidden}
            return forward(batch)

        def spy_launch(batch: Any, *rest: Any) -> Any:
            self.launched |= {c.seq_id for c in batch.chunks}
            return launch(batch, *rest)

        eng.runner.forward, eng.runner.launch = spy_forward, spy_launch  # type: ignore[attr-defined]


class Run:
    """Requests r0.. with `methods`; `late` = (method, step): one more request (r_late) added at that step."""

    def __init__(self, eng: Engine, methods: list[str], late: tuple[str, int] | None = None) -> None:
        self.seq_ids: dict[str, int] = {}
        self.done: dict[str, list[int]] = {}
        for i, (p, m) in enumerate(zip(PROMPTS, methods)):
            self.add(eng, f"r{i}", p, m)
        step = 0
        while eng.has_unfinished():
            if late is not None and step == late[1]:
                self.add(eng, "r_late", PROMPTS[0], late[0])
            for out in eng.step():
                if out.finished:
                    self.done[out.request_id] = out.token_ids
            step += 1

    def add(self, eng: Engine, rid: str, prompt: list[int], method: str) -> None:
        eng.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True, speculative=method), request_id=rid)
        self.seq_ids[rid] = eng._live[rid].seq_id


@pytest.fixture(scope="module")
def plain(folder: Path) -> dict[str, list[int]]:
    return Run(engine(folder, lookahead=False), ["off"] * 4).done


@pytest.mark.parametrize("methods,mtp_in_auto", [(["off"] * 4, True), (["auto"] * 4, False)],
                         ids=["off", "auto-without-head-above-the-limit"])
def test_a_head_nobody_uses_leaves_lookahead_on(folder: Path, plain: dict, methods: list[str],
                                                mtp_in_auto: bool) -> None:
    eng = engine(folder, mtp_in_auto=mtp_in_auto)
    spy = Spy(eng)
    assert Run(eng, methods).done == plain
    st = eng.stats()
    assert st["lookahead_steps"] > 0 and spy.launched
    assert st["mtp_head_runs"] == 0 and st["spec_verify_windows"] == 0


@pytest.mark.parametrize("methods,mtp_in_auto", [(["mtp", "off", "off", "off"], False), (["auto"] * 4, True)],
                         ids=["one-mtp-request", "auto-with-head"])
def test_a_request_using_the_head_runs_plain_steps(folder: Path, plain: dict, methods: list[str],
                                                   mtp_in_auto: bool) -> None:
    eng = engine(folder, mtp_in_auto=mtp_in_auto)
    spy = Spy(eng)
    run = Run(eng, methods)
    assert run.done == plain
    head_users = {run.seq_ids[f"r{i}"] for i, m in enumerate(methods) if m == "mtp" or mtp_in_auto}
    st = eng.stats()
    # with a request on the head running from the first step to the last (24 tokens each), nothing is launched
    assert st["lookahead_steps"] == 0 and not spy.launched
    assert st["mtp_head_runs"] > 0 and not head_users & spy.not_kept


def test_a_head_request_arriving_while_steps_run_ahead_stops_them(folder: Path, plain: dict) -> None:
    eng = engine(folder, mtp_in_auto=False)
    spy = Spy(eng)
    run = Run(eng, ["off"] * 3, late=("mtp", 12))
    assert {k: v for k, v in run.done.items() if k != "r_late"} == {f"r{i}": plain[f"r{i}"] for i in range(3)}
    assert run.done["r_late"] == plain["r0"]  # the same prompt, greedy
    late = run.seq_ids["r_late"]
    assert spy.launched and late not in spy.launched and late not in spy.not_kept
    assert eng.stats()["lookahead_steps"] > 0 and eng.stats()["mtp_head_runs"] > 0
