"""Request-level isolation: a forward that raises because of one request ends that request only; the others go on
and produce exactly what they would have produced in a clean run."""
from __future__ import annotations

import numpy as np
import pytest
from test_engine_core_fakes import FakeRunner, text_prompt, tiny_tokenizer, vision_prompt

from gpu_engine.engine import Engine
from gpu_engine.engine_config import EngineConfig
from gpu_engine.params import SamplingParams
from gpu_engine.runner_api import StepBatch, StepOutput

POISON = 2064  # a token id the poisoned runner cannot process; clean prompts draw from [0, 2000) (+ image 2060)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


class ChunkwiseRunner(FakeRunner):
    """Runs a batch chunk by chunk, as a real runner's kernels would, so a failure part-way leaves the earlier
    chunks' KV and linear-attention state already written (the half-written state the engine must not reuse)."""

    def __init__(self, poison: int | None = None, fail_big_batches: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.poison = poison
        # The first `fail_big_batches` forwards of >= 3 chunks fail half-way whatever they hold (a transient
        # out-of-memory); the smaller re-runs succeed.
        self.big_failures_left = fail_big_batches
        self.failures = 0
        self._out = np.zeros((64, self.vocab_size), np.float32)

    def forward(self, batch: StepBatch) -> StepOutput:
        rows, offsets = [], [0]
        oom = self.big_failures_left > 0 and len(batch.chunks) >= 3
        for k, c in enumerate(batch.chunks):
            if oom and k == len(batch.chunks) // 2:
                self.big_failures_left -= 1
                self.failures += 1
                raise RuntimeError("out of memory")
            if self.poison is not None and self.poison in c.token_ids:
                self.failures += 1
                raise FloatingPointError(f"non-finite activations at token {self.poison}")
            out = super().forward(StepBatch([c]))
            out.logits[:, POISON] = -1e9  # never generated, so only the prompts chosen here carry it
            rows.append(out.logits)
            offsets.append(offsets[-1] + out.logits.shape[0])
        # Like a GPU runner's host output buffer: every forward returns a view of the same array.
        self._out[: offsets[-1]] = np.concatenate(rows)
        return StepOutput(logits=self._out[: offsets[-1]], row_offsets=offsets)


def fresh_rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)


def make_engine(tok, runner, **cfg) -> Engine:
    cfg.setdefault("num_kv_blocks", 256)
    return Engine(runner, tok, vocab_size=2074, config=EngineConfig(**cfg))


def clean_prompts(rng, n):
    out = []
    for i in range(n):
        if i % 4 == 1:
            out.append(vision_prompt(rng, [int(rng.integers(2, 8)),
                                           ("image", int(rng.integers(3, 9)), f"im{i}{rng.random()}"),
                                           int(rng.integers(1, 6))]))
        else:
            out.append(text_prompt(rng.integers(0, 2000, size=int(rng.integers(1, 40)))))
    return out


def clean_run(tok, prompts, params, linear_state):
    """The same requests on the same runner without poison or failures (batch composition does not change
    FakeRunner's outputs, so this is also what each request yields alone)."""
    eng = make_engine(tok, ChunkwiseRunner(linear_state=linear_state), max_num_seqs=4, max_batched_tokens=64)
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("linear_state", [True, False])
def test_poisoned_requests_fail_alone(tok, linear_state):
    rng = fresh_rng()
    prompts = clean_prompts(rng, 10)
    params = [SamplingParams(max_tokens=int(rng.integers(2, 12)), ignore_eos=True) for _ in prompts]
    expected = clean_run(tok, prompts, params, linear_state)

    # Poison deep inside a long prompt (met by a later prefill chunk, start > 0, after other chunks of the batch ran)
    # and at the start of a short one.
    deep = rng.integers(0, 2000, size=45)
    deep[37] = POISON
    shallow = np.array([POISON, 5, 6])
    bad_at = {3, 7}
    all_prompts = prompts[:3] + [text_prompt(deep)] + prompts[3:6] + [text_prompt(shallow)] + prompts[6:]
    all_params = params[:3] + [params[0]] + params[3:6] + [params[1]] + params[6:]

    runner = ChunkwiseRunner(POISON, linear_state=linear_state)
    eng = make_engine(tok, runner, max_num_seqs=6, max_batched_tokens=16, block_size=4, num_kv_blocks=40)
    outs = eng.generate(all_prompts, all_params)

    for i in bad_at:
        assert outs[i].finish_reason == "error"
        assert "FloatingPointError" in outs[i].error and f"token {POISON}" in outs[i].error
    assert [o.token_ids for i, o in enumerate(outs) if i not in bad_at] == expected
    assert all(o.finish_reason == "length" for i, o in enumerate(outs) if i not in bad_at)
    st = eng.stats()
    # Both poisoned requests may fail in the same step (one failed forward, two culprits).
    assert runner.failures >= 2 and st["forward_failures"] >= 1 and st["requests_failed_by_runner"] == 2
    if linear_state:
        assert st["preempted_after_failure"] > 0, "survivors continuing a sequence must rebuild their state"
    else:
        assert st["preempted_after_failure"] == 0, "without linear state the retried rows are kept"
    assert st["kv_blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0


@pytest.mark.parametrize("linear_state", [True, False])
def test_transient_batch_failure_loses_no_request(tok, linear_state):
    """A forward that fails once for the batch as a whole (no culprit: the halves run) costs no request."""
    rng = fresh_rng()
    prompts = clean_prompts(rng, 6)
    params = [SamplingParams(max_tokens=int(rng.integers(3, 10)), ignore_eos=True) for _ in prompts]
    expected = clean_run(tok, prompts, params, linear_state)
    runner = ChunkwiseRunner(fail_big_batches=2, linear_state=linear_state)
    eng = make_engine(tok, runner, max_num_seqs=4, max_batched_tokens=24)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert eng.stats()["forward_failures"] == runner.failures == 2
    assert eng.stats()["requests_failed_by_runner"] == 0


def test_runner_that_always_fails_fails_every_request_then_recovers(tok):
    class Broken(FakeRunner):
        broken = True

        def forward(self, batch):
            if self.broken:
                raise RuntimeError("device lost")
            return super().forward(batch)

    runner = Broken()
    eng = make_engine(tok, runner)
    outs = eng.generate([[1, 2, 3], [4, 5], [6]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["error"] * 3 and all("device lost" in o.error for o in outs)
    assert eng.stats()["isolation_forwards"] == 4  # 3 chunks: halves [a] [b c], then [b] [c]
    runner.broken = False
    later = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert later.finish_reason == "length" and len(later.token_ids) == 4
    assert eng.stats()["kv_blocks_used"] == 0


def test_poisoned_request_on_the_reference_runner(tmp_path):
    """The same with the real numpy runner of a tiny hybrid model (linear-attention layers + full attention): the
    batch runs chunk by chunk through it and stops at the poisoned chunk, leaving real half-written DeltaNet state
    and KV behind. The survivors' greedy tokens must equal those of the one-request-at-a-time model helper."""
    import gpu_engine
    from gpu_engine.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", seed=3)
    oracle = gpu_engine.load(ckpt)
    assert "linear_attention" in oracle.config.text.layer_types
    rng = fresh_rng()
    prompts = [rng.integers(0, 2000, size=int(rng.integers(3, 30))).tolist() for _ in range(6)]
    max_tokens = [int(rng.integers(3, 9)) for _ in prompts]
    expected = [oracle.generate(p, max_tokens=n, stop_token_ids=[]) for p, n in zip(prompts, max_tokens)]
    poisoned = rng.integers(0, 2000, size=26).tolist()
    poisoned[20] = POISON

    eng = Engine.from_pretrained(ckpt, config=EngineConfig(max_num_seqs=4, max_batched_tokens=12, block_size=4))
    forward = eng.runner.forward

    def chunkwise_forward(batch: StepBatch) -> StepOutput:
        rows, offsets = [], [0]
        for c in batch.chunks:
            if POISON in c.token_ids:
                raise FloatingPointError("non-finite activations")
            out = forward(StepBatch([c]))
            rows.append(out.logits)
            offsets.append(offsets[-1] + out.logits.shape[0])
        return StepOutput(logits=np.concatenate(rows), row_offsets=offsets)

    eng.runner.forward = chunkwise_forward  # type: ignore[method-assign]  # a runner failing per chunk
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = eng.generate(prompts[:2] + [poisoned] + prompts[2:], params[:2] + [params[0]] + params[2:])
    assert outs[2].finish_reason == "error" and "FloatingPointError" in outs[2].error
    assert [o.token_ids for o in outs[:2] + outs[3:]] == expected
    st = eng.stats()
    assert st["requests_failed_by_runner"] == 1 and st["preempted_after_failure"] > 0
