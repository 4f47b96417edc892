"""GPU check: the checkpoint's MTP head on the CUDA runner (gpu_engine/cuda/mtp.py) against the reference runner.

    python3 -m tests.cuda_runner.check_mtp [--json out.json] [--seed N]

Per tiny random Qwen3.5 checkpoint (check_runner's two configs, with a random MTP head: mtp=True) and dtype (f32,
bf16): (1) drafts — an engine whose runner sends every call to both the CUDA runner and the reference runner (the
reference gets the bf16-rounded weights in bf16) runs two prompts with speculative="mtp", k = 3; every mtp_draft call's
CUDA drafts are compared with the reference's for the same requests (same tokens, same KV history). Pass: f32 every
draft equal (divergent hidden states of 1e-4 can flip only a near tie: reported); bf16 the share is reported and
must be >= BF16_MIN_SHARE. (2) exactness — greedy output of the CUDA engine with speculative="mtp" (rollback
recompute and window) and with `auto` opted in (CudaOptions.mtp_in_auto) equals the same runner without
speculation token for token (bf16: a divergence only at a near tie of the plain run, as check_speculative); a tiny
qwen3_5_moe checkpoint's head (routed experts, one tensor per expert) gets the first exactness row.
Skips (exit 0) without a GPU.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpu_engine.params import SamplingParams
from tests.cuda_runner.check_runner import CONFIGS, _rounded
from tests.cuda_runner.check_speculative import compare, prompts, run
from tests.cuda_runner.harness import check_main, fresh_seed

K = 3
MAX_TOKENS = 20
F32_MIN_SHARE = 0.98  # f32 drafts: equal but for near ties of the head's logits (1e-4 apart hidden states)
EXACT_ROWS = [("mtp, recompute", "recompute", "mtp"), ("mtp, window", "window", "mtp"),
              ("auto + mtp_in_auto", "recompute", "auto")]  # (row, CudaOptions.rollback, speculative)
PARAMS = {m: SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=2, speculative=m)
          for m in ("off", "mtp", "auto")}
TEE_PROMPTS = 2  # prompts of the drafts-vs-reference run (the numpy reference runner sets its time)
BF16_MIN_SHARE = 0.6  # bf16 drafts: random heads have flat logits, bf16 activations flip their argmax more often


@dataclass
class MtpResult:
    config: str
    dtype: str
    row: str  # "drafts vs reference" or the speculative run compared with plain decoding
    drafts: int  # drafts compared (draft rows) / drafted tokens (exactness rows)
    share: float  # equal drafts / drafts (draft rows); accepted / drafted (exactness rows)
    identical: bool
    ok: bool
    note: str = ""


class Tee:
    """A runner that sends every call to the CUDA runner and the reference runner; answers are the CUDA one's,
    mtp_draft's drafts are compared."""

    name = "cuda"
    supports_verify = True
    mtp_head = True
    samples_on_device = False

    def __init__(self, cuda: Any, ref: Any) -> None:
        self.cuda, self.ref = cuda, ref
        self.max_decode_chunk_tokens = getattr(cuda, "max_decode_chunk_tokens", None)
        self.max_verify_drafts = getattr(cuda, "max_verify_drafts", None)
        self.compared = self.equal = 0
        self.first_diff = ""

    def allocate_cache(self, spec: Any) -> None:
        self.cuda.allocate_cache(spec)
        self.ref.allocate_cache(spec)

    def kv_bytes_per_block(self, block_size: int | None = None) -> int:
        return int(self.cuda.kv_bytes_per_block(block_size))

    def state_bytes_per_slot(self) -> int:
        return int(self.cuda.state_bytes_per_slot())

    def embedding_nbytes(self, item: Any) -> int:
        return int(self.cuda.embedding_nbytes(item))

    def encode_vision(self, item: Any) -> Any:
        raise RuntimeError("check_mtp runs text prompts only: its Tee encodes no images")

    def verify_room(self) -> int:
        room = getattr(self.cuda, "verify_room", None)  # the CPU driver test's stand-in has none
        return int(room()) if room is not None else 1 << 30

    def forward(self, batch: Any) -> Any:
        self.ref.forward(batch)
        return self.cuda.forward(batch)

    def rollback_state(self, slot: int, keep: int) -> None:
        self.cuda.rollback_state(slot, keep)
        self.ref.rollback_state(slot, keep)

    def copy_state_slot(self, src: int, dst: int) -> None:
        self.cuda.copy_state_slot(src, dst)
        self.ref.copy_state_slot(src, dst)

    def mtp_draft(self, requests: list[Any]) -> list[list[int]]:
        want = self.ref.mtp_draft(requests)
        got = self.cuda.mtp_draft(requests)
        for r, a, b in zip(requests, got, want):
            same = sum(int(x == y) for x, y in zip(a, b))
            self.compared += len(b)
            self.equal += same
            if same < len(b) and not self.first_diff:
                self.first_diff = f"seq {r.seq_id} at {r.start}: cuda {a} vs reference {b}"
        return got


def engine_for(runner: Any, loaded: Any, folder: Path, k: int) -> Any:
    from gpu_engine.engine import Engine
    from gpu_engine.engine_config import EngineConfig
    from gpu_engine.speculative import SpeculativeConfig
    from gpu_engine.tokenizer import Tokenizer

    return Engine(runner, Tokenizer.from_pretrained(folder), vocab_size=loaded.config.text.vocab_size,
                  config=EngineConfig(max_num_seqs=4, block_size=4, num_kv_blocks=160),
                  speculative=SpeculativeConfig(num_tokens=k), prepare=loaded.prepare)


def run_all(seed: int | None = None) -> tuple[list[MtpResult], dict]:
    import gpu_engine
    from gpu_engine.cuda.device import require_gpu
    from gpu_engine.tiny import make_tiny_checkpoint
    from gpu_engine.tiny_moe import make_tiny_moe_checkpoint

    require_gpu()
    seed = fresh_seed(seed)
    results: list[MtpResult] = []
    cases = [(name, lambda f, c=cfg: make_tiny_checkpoint(f, seed=seed % 1000, text_config=c, mtp=True), EXACT_ROWS)
             for name, cfg in CONFIGS.items()]
    # a qwen3_5_moe head (its MLP the routed experts, stored one tensor per expert): exactness only
    cases.append(("moe tiny (per-expert MTP head)", lambda f: make_tiny_moe_checkpoint(f, seed=seed % 1000, mtp=True),
                  EXACT_ROWS[:1]))
    for cname, make, exact in cases:
        with tempfile.TemporaryDirectory() as tmp:
            # the head as a checkpoint holds it (mtp.* in the safetensors, read by the loader)
            folder = make(Path(tmp) / "m")
            loaded = gpu_engine.load(folder)
            prompt_ids = prompts(np.random.default_rng(seed), loaded.config.text.vocab_size)
            for dtype in ("f32", "bf16"):
                try:
                    plain = plain_run(loaded, folder, dtype, prompt_ids)
                except Exception as exc:  # noqa: BLE001 - the other dtypes and checkpoints still run
                    results.append(MtpResult(cname, dtype, "plain run", 0, 0.0, False, False,
                                             f"{type(exc).__name__}: {exc}"[:300]))
                    print(format_table(results[-1:]).splitlines()[-1], flush=True)
                    continue
                if exact is EXACT_ROWS:
                    results.append(draft_row(cname, dtype, loaded, folder, prompt_ids[:TEE_PROMPTS]))
                    print(format_table(results[-1:]).splitlines()[-1], flush=True)
                for row in exact:
                    results.append(exact_row(cname, dtype, row, loaded, folder, prompt_ids, plain))
                    print(format_table(results[-1:]).splitlines()[-1], flush=True)
    return results, {"seed": seed, "k": K, "max_tokens": MAX_TOKENS, "f32_min_share": F32_MIN_SHARE,
                     "bf16_min_share": BF16_MIN_SHARE}


def plain_run(loaded: Any, folder: Path, dtype: str, prompt_ids: list[list[int]]) -> dict:
    """The CUDA runner's greedy outputs without speculation (the runner must have the head: it is checked here)."""
    runner = cuda_runner(loaded.config, loaded.runner.weights, dtype)
    try:
        if not runner.mtp_head:
            raise RuntimeError(f"no MTP head on the CUDA runner: {runner.mtp_problem}")
        return run(engine_for(runner, loaded, folder, 0), prompt_ids, PARAMS["off"])
    finally:
        runner.close()


def draft_row(cname: str, dtype: str, loaded: Any, folder: Path, prompt_ids: list[list[int]]) -> MtpResult:
    """(1): every mtp_draft's CUDA drafts against the reference runner's, same requests."""
    from gpu_engine.reference.runner import ReferenceRunner

    weights = loaded.runner.weights
    ref_weights = weights if dtype == "f32" else _with_mtp(_rounded(weights), weights)
    row = "drafts vs reference"
    tee = None
    try:
        tee = Tee(cuda_runner(loaded.config, weights, dtype), ReferenceRunner(loaded.config, ref_weights))
        run(engine_for(tee, loaded, folder, K), prompt_ids, PARAMS["mtp"])
        share = tee.equal / max(tee.compared, 1)
        floor = F32_MIN_SHARE if dtype == "f32" else BF16_MIN_SHARE
        return MtpResult(cname, dtype, row, tee.compared, share, tee.equal == tee.compared,
                         tee.compared > 0 and share >= floor, tee.first_diff[:200])
    except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
        return MtpResult(cname, dtype, row, 0, 0.0, False, False, f"{type(exc).__name__}: {exc}"[:300])
    finally:
        if tee is not None:
            tee.cuda.close()


def exact_row(cname: str, dtype: str, row: tuple[str, str, str], loaded: Any, folder: Path,
              prompt_ids: list[list[int]], plain: dict) -> MtpResult:
    """(2): greedy output of a speculative run on the CUDA runner alone against its plain run."""
    name, rollback, method = row
    runner = None
    try:
        runner = cuda_runner(loaded.config, loaded.runner.weights, dtype, rollback, auto=method == "auto")
        eng = engine_for(runner, loaded, folder, K)
        got = run(eng, prompt_ids, PARAMS[method])
        st = eng.stats()
        same, tie, note = compare(plain, got)
        drafted, accepted = int(st["spec_draft_tokens"]), int(st["spec_accepted_tokens"])
        ran = int(st["mtp_head_runs"]) > 0
        return MtpResult(cname, dtype, name, drafted, accepted / max(drafted, 1), same,
                         ran and (same or (dtype == "bf16" and tie)), note if ran else "the MTP head never ran")
    except Exception as exc:  # noqa: BLE001 - one failing row must not hide the others
        return MtpResult(cname, dtype, name, 0, 0.0, False, False, f"{type(exc).__name__}: {exc}"[:300])
    finally:
        if runner is not None:
            runner.close()


def cuda_runner(config: Any, weights: Any, dtype: str, rollback: str = "recompute", auto: bool = False) -> Any:
    from gpu_engine.cuda.options import CudaOptions
    from gpu_engine.cuda.runner import CudaRunner

    return CudaRunner(config, weights, CudaOptions(dtype=dtype, memory_budget=1 << 30, rollback=rollback,
                                                   mtp_in_auto=auto))


def _with_mtp(rounded: Any, weights: Any) -> Any:
    """The bf16-rounded trunk with the MTP head rounded too (the bf16 runner stores bf16 weights)."""
    from gpu_engine.cuda.bf16 import round_to_bf16
    from gpu_engine.loader import ModelWeights

    mtp = {k: round_to_bf16(np.asarray(weights.mtp[k], np.float32)) for k in weights.mtp}
    return ModelWeights(text=rounded.text, vision=rounded.vision, lm_head=rounded.lm_head, mtp=mtp)


def format_table(results: list[MtpResult]) -> str:
    lines = [f"{'config':<40} {'dtype':<5} {'row':<20} {'drafts':>6} {'share':>6} {'same':>5}  ok", "-" * 92]
    for r in results:
        lines.append(f"{r.config:<40} {r.dtype:<5} {r.row:<20} {r.drafts:>6} {r.share:>6.3f} "
                     f"{'yes' if r.identical else 'no':>5}  {'PASS' if r.ok else 'FAIL'}" + (f"  {r.note}" if r.note
                                                                                              else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return check_main(__doc__.splitlines()[0], run_all, format_table, argv)


if __name__ == "__main__":
    sys.exit(main())
