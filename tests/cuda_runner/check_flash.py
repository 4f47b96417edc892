"""Check the tensor-core prefill attention (ops.flash_prefill) against a float64 numpy reference.

Run on a GPU machine:   python3 -m tests.cuda_runner.check_flash [--json out.json] [--seed N]
Without a GPU or cuda-python it prints why and exits 0 (skip). Exit 1 if any case fails.

Every case draws fresh random inputs (the seed is printed), fills the whole paged cache with random garbage
(a reused cache is never clean), hands each sequence a random permutation of blocks, poisons the output (0xFF =
NaN) before the launch, and compares ||out - ref|| / ||ref|| with the bf16 tolerance 1e-2. Cases: head dims 128 and
256; GQA 6:1, 4:1 and 1:1; chunks of 1, 15, 64, 200 and 1000 tokens; continued prefill (earlier positions already
in the cache); several sequences in one launch; block sizes 16 and 64.
Every head_dim 256 case also runs the warp-specialised wgmma kernel (flash_prefill variant "ws", 128-row tiles, rows
marked [ws]) where the device has it (sm_90), with the same rule; WS_CASES add the model shapes' GQA (16 / 4, 24 / 4),
tiles of fewer than 128 rows, a 4-chunk step continuing from cached tokens and block size 24 (not a power of 2).
`--ws-variants ws,ws2` also runs flash_prefill_ws.cu's second kernel ("ws2", rows marked [ws2]) on those cases.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from gpu_engine.cuda import flash_plan
from tests.cuda_runner import references as ref
from tests.cuda_runner.harness import Result, check_main, rel_err, result_table, run_checks, run_guarded

TOL = 1e-2


@dataclass
class FlashCase:
    """Host inputs of one flash_prefill launch. seqs: (start, new tokens) per sequence; the cache already holds
    positions 0..start-1 and (as after qk_norm_rope_store) the new ones too."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    seqs: list[tuple[int, int]]
    cache_k: np.ndarray  # [blocks, block_size, kv_heads, head_dim], bf16-exact float32
    cache_v: np.ndarray
    tables: np.ndarray  # i32 [seqs, max blocks]
    token_seq: np.ndarray  # i32 [n]
    token_pos: np.ndarray  # i32 [n]
    q_gate: np.ndarray  # [n, heads, 2, head_dim]: q | gate per head, as the q projection emits them

    @property
    def q(self) -> np.ndarray:
        return self.q_gate[:, :, 0]

    @property
    def gate(self) -> np.ndarray:
        return self.q_gate[:, :, 1]

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    def keys(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of sequence i, positions 0..start+n-1, gathered through its block table: [L, kv_heads, hd]."""
        s, n = self.seqs[i]
        p = np.arange(s + n)
        blocks = self.tables[i, p // self.block_size]
        return self.cache_k[blocks, p % self.block_size], self.cache_v[blocks, p % self.block_size]


def make_case(rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int, block_size: int,
              seqs: list[tuple[int, int]]) -> FlashCase:
    from gpu_engine.cuda.bf16 import round_to_bf16

    def rand(shape: tuple[int, ...]) -> np.ndarray:
        return round_to_bf16(rng.standard_normal(shape).astype(np.float32))

    need = [-(-(s + n) // block_size) for s, n in seqs]
    num_blocks = sum(need) + 2  # two blocks nobody owns: garbage a wrong table lookup would read
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = np.zeros((len(seqs), max(need)), np.int32)
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    token_seq = np.concatenate([np.full(n, i, np.int32) for i, (_, n) in enumerate(seqs)])
    token_pos = np.concatenate([np.arange(s, s + n, dtype=np.int32) for s, n in seqs])
    return FlashCase(heads, kv_heads, head_dim, block_size, seqs,
                     rand((num_blocks, block_size, kv_heads, head_dim)),
                     rand((num_blocks, block_size, kv_heads, head_dim)), tables, token_seq, token_pos,
                     rand((token_seq.size, heads, 2, head_dim)))


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, gate: np.ndarray, positions: np.ndarray,
                  scale: float) -> np.ndarray:
    """references.attention in matrix form (same math, float64; fast enough for 1000-token chunks):
    q/gate [n, H, D] at `positions`; k/v [L, KV, D]; returns [n, H*D]."""
    n, H, D = q.shape
    group = H // k.shape[1]
    out = np.empty((n, H, D))
    visible = np.arange(k.shape[0])[None, :] <= positions[:, None]  # [n, L]
    for h in range(H):
        # einsum, not @: BLAS thread pools crawl on busy CI machines, and these matrices are small
        s = np.einsum("nd,ld->nl", q[:, h].astype(np.float64), k[:, h // group].astype(np.float64)) * scale
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = np.einsum("nl,ld->nd", w / w.sum(-1, keepdims=True), v[:, h // group].astype(np.float64))
    return (out * ref.sigmoid(gate)).reshape(n, H * D)


def expected(case: FlashCase) -> np.ndarray:
    outs, row = [], 0
    for i, (s, n) in enumerate(case.seqs):
        k, v = case.keys(i)
        outs.append(attention_f64(case.q[row : row + n], k, v, case.gate[row : row + n], np.arange(s, s + n),
                                  case.scale))
        row += n
    return np.concatenate(outs)


# (name, heads, kv_heads, head_dim, block_size, seqs)
CASES: list[tuple[str, int, int, int, int, list[tuple[int, int]]]] = [
    ("hd256 6:1 chunk 1", 12, 2, 256, 16, [(0, 1)]),
    ("hd256 6:1 chunk 15", 12, 2, 256, 16, [(0, 15)]),
    ("hd256 6:1 chunk 64", 12, 2, 256, 16, [(0, 64)]),
    ("hd256 6:1 chunk 200", 12, 2, 256, 16, [(0, 200)]),
    ("hd256 6:1 chunk 1000", 6, 1, 256, 64, [(0, 1000)]),
    ("hd256 4:1 continued 300+200", 8, 2, 256, 16, [(300, 200)]),
    ("hd256 4:1 varlen 5 seqs", 8, 2, 256, 64, [(0, 1), (37, 15), (0, 64), (129, 200), (5, 77)]),
    ("hd256 1:1 continued 63+65", 2, 2, 256, 64, [(63, 65)]),
    ("hd128 6:1 chunk 1", 12, 2, 128, 16, [(0, 1)]),
    ("hd128 6:1 chunk 15", 12, 2, 128, 64, [(0, 15)]),
    ("hd128 6:1 chunk 64", 12, 2, 128, 16, [(0, 64)]),
    ("hd128 4:1 chunk 200", 8, 2, 128, 64, [(0, 200)]),
    ("hd128 4:1 chunk 1000", 4, 1, 128, 16, [(0, 1000)]),
    ("hd128 6:1 continued 1000+64", 12, 2, 128, 16, [(1000, 64)]),
    ("hd128 4:1 varlen 4 seqs", 8, 2, 128, 16, [(70, 200), (0, 1), (17, 33), (0, 130)]),
]
# head_dim 256 at the 9B (16 / 4 heads) and 27B (24 / 4) GQA, for both kernels
WS_CASES: list[tuple[str, int, int, int, int, list[tuple[int, int]]]] = [
    ("hd256 16:4 chunk 257 (tiles 128, 128, 1)", 16, 4, 256, 16, [(0, 257)]),
    ("hd256 16:4 chunk 128", 16, 4, 256, 64, [(0, 128)]),
    ("hd256 24:4 continued 200+190", 24, 4, 256, 64, [(200, 190)]),
    ("hd256 16:4 continued 2048+512", 16, 4, 256, 16, [(2048, 512)]),
    ("hd256 16:4 step 4 x (384+384)", 16, 4, 256, 16, [(384, 384)] * 4),
    ("hd256 16:4 varlen 4 seqs", 16, 4, 256, 16, [(0, 1), (70, 130), (0, 64), (129, 100)]),
    ("hd256 24:4 bs 24 varlen", 24, 4, 256, 24, [(100, 150), (0, 33), (5, 1)]),
    ("hd256 4:1 bs 24 chunk 1000", 4, 1, 256, 24, [(0, 1000)]),
]


class FlashChecker:
    ws_variants: tuple[str, ...] = ("ws",)  # the ws kernels checked where the device has them (--ws-variants)

    def __init__(self, ctx, rng: np.random.Generator) -> None:
        from gpu_engine.cuda import ops

        self.ctx, self.rng, self.ops = ctx, rng, ops
        self.results: list[Result] = []

    def variants(self, head_dim: int) -> list[str]:
        """fa2, and the ws kernels where this device runs them for a bf16 cache at this head dim (flash_variant)."""
        arch = self.ctx.device.info.arch
        return ["fa2"] + [v for v in self.ws_variants if flash_plan.flash_variant(v, head_dim, False, arch) == v]

    def launch(self, case: FlashCase, variant: str = "fa2") -> np.ndarray:
        ctx, ops = self.ctx, self.ops
        n, H, D = case.token_seq.size, case.heads, case.head_dim
        up = ctx.to_device
        q_gate = up(case.q_gate.reshape(n, -1), "bf16", "q_gate")  # gate read in place: stride 2*H*D, head 2*D
        q = up(np.ascontiguousarray(case.q).reshape(n, -1), "bf16", "q")
        out = ctx.empty((n, H * D), "bf16", "out")
        ctx.poison(out)
        ops.flash_prefill(ctx, out, q, H * D, q_gate.at(D), 2 * H * D, 2 * D, up(case.cache_k, "bf16", "k"),
                          up(case.cache_v, "bf16", "v"), up(case.tables, "i32", "tables"),
                          up(case.token_seq, "i32", "seq"), up(case.token_pos, "i32", "pos"),
                          up(flash_plan.flash_tiles([m for _, m in case.seqs], flash_plan.FLASH_TILE_ROWS[variant]),
                             "i32", "tiles"), H, case.kv_heads, D, case.block_size, case.scale, variant=variant)
        ctx.device.sync()
        return ctx.to_host(out)

    def run(self, name: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
            seqs: list[tuple[int, int]]) -> None:
        case = make_case(self.rng, heads, kv_heads, head_dim, block_size, seqs)
        want = expected(case)
        for variant in self.variants(head_dim):
            label = f"{name} (bs {block_size})" + ("" if variant == "fa2" else f" [{variant}]")

            def one(variant: str = variant, label: str = label) -> None:
                err = rel_err(self.launch(case, variant), want)
                self.results.append(Result(label, "bf16", err, TOL, bool(np.isfinite(err) and err <= TOL)))

            run_guarded(self.ctx, self.results, label, "bf16", TOL, one)


def run_all(seed: int | None = None) -> tuple[list[Result], dict]:
    """Run every case; raises CudaUnavailable when there is no GPU / cuda-python."""
    return run_checks(seed, 1 << 30, FlashChecker, CASES + WS_CASES, lambda checker, case: checker.run(*case))


def format_table(results: list[Result]) -> str:
    return result_table(results, width=52, first="case", dtype=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ws-variants", default="ws")
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    FlashChecker.ws_variants = tuple(known.ws_variants.split(","))
    return check_main(__doc__.splitlines()[0], run_all, format_table, rest)


if __name__ == "__main__":
    sys.exit(main())
