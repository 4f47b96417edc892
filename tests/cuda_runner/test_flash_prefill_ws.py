"""The warp-specialised prefill attention (kernels/flash_prefill_ws.cu, flash_prefill variant "ws") on the CPU: its
host constants, the option and its resolution, the 128-row tiles where the step tables are built, the launches,
its tile bookkeeping emulated in numpy against float64 attention, and its K / V mbarrier rings replayed under random
interleavings of the producer and the two consumer warpgroups. The kernel itself: check_flash on a GPU."""
from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import flash_plan, ops
from gpu_engine.cuda.device import KERNEL_DIR, compile_arch, expand_source
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.options import CudaOptions
from gpu_engine.cuda.runner import CudaRunner
from gpu_engine.cuda.step import build_step, pad_step
from gpu_engine.runner_api import StepBatch
from tests.cuda_runner.check_flash import expected, make_case
from tests.cuda_runner.flash_ws_emulation import BN, WsTrace, flash_prefill_ws_emulated, warpgroup_tiles
from tests.cuda_runner.harness import rel_err
from tests.cuda_runner.no_launch import arr
from tests.cuda_runner.test_decode_rows_apart import CFG, SPEC, _attention_launches, chunk, mixed_batch
from tests.cuda_runner.test_flash_tiling import flash_args

SOURCE = Path(KERNEL_DIR) / "flash_prefill_ws.cu"
WS_ROWS = flash_plan.FLASH_TILE_ROWS["ws"]


def define(name: str) -> int:
    return int(re.search(rf"#define {name} (\d+)", SOURCE.read_text()).group(1))


# ---- host constants, option, resolution ------------------------------------------------------------------------
def test_host_constants_match_the_kernel_source() -> None:
    src = expand_source(SOURCE)
    assert compile_arch("sm_90", src) == "sm_90a" and compile_arch("sm_80", src) == "sm_80"
    assert re.search(r"__launch_bounds__\(FW_THREADS, 1\) flash_prefill_ws_bf16_hd256\(", src)
    assert define("FW_ROWS") == WS_ROWS == 2 * 64 and define("FW_THREADS") == flash_plan.FLASH_WS_THREADS == 3 * 128
    assert define("FW_HD") == flash_plan.FLASH_WS_HEAD_DIM and define("FW_BN") == BN
    assert (define("FW_K_STAGES"), define("FW_V_STAGES")) == flash_plan.FLASH_WS_STAGES
    # FwShape: K and V stages of 64 rows x 256 bf16, then 128 Q rows; one block an SM (227 KiB at most)
    stages = define("FW_K_STAGES") + define("FW_V_STAGES")
    assert flash_plan.flash_shared_bytes(256, ws=True) == (stages * 64 + WS_ROWS) * 256 * 2 == 229_376
    assert flash_plan.flash_shared_bytes(256, ws=True) + 128 <= 227 * 1024  # + the static barriers
    assert 128 * define("FW_PRODUCER_REGS") + 2 * 128 * define("FW_CONSUMER_REGS") <= 65536


def test_option_default_environment_and_refusal() -> None:
    assert CudaOptions().flash_prefill == "ws"
    assert CudaOptions.from_env({}).flash_prefill == "ws"
    assert CudaOptions.from_env({"DOCPIPE_CUDA_FLASH_PREFILL": "fa2"}).flash_prefill == "fa2"
    assert CudaOptions.from_env({"DOCPIPE_CUDA_FLASH_PREFILL": ""}).flash_prefill == "ws"  # empty = unset
    for bad in ("fa3", "WS", "wgmma"):
        with pytest.raises(ShapeError, match="DOCPIPE_CUDA_FLASH_PREFILL"):
            CudaOptions.from_env({"DOCPIPE_CUDA_FLASH_PREFILL": bad})
        with pytest.raises(ShapeError, match="DOCPIPE_CUDA_FLASH_PREFILL"):
            CudaOptions(flash_prefill=bad)


def test_ws_only_for_a_bf16_cache_at_head_dim_256_on_sm_90() -> None:
    assert flash_plan.flash_variant("ws", 256, False, "sm_90") == "ws"
    assert flash_plan.flash_variant("ws", 256, True, "sm_90") == "fa2"  # FP8 cache
    assert flash_plan.flash_variant("ws", 128, False, "sm_90") == "fa2"
    assert flash_plan.flash_variant("ws", 256, False, "sm_80") == "fa2"
    assert flash_plan.flash_variant("ws", 256, False, None) == "fa2"
    assert flash_plan.flash_variant("fa2", 256, False, "sm_90") == "fa2"
    with pytest.raises(ShapeError, match="variant"):
        flash_plan.flash_variant("fa3", 256, False, "sm_90")


# ---- tiles ---------------------------------------------------------------------------------------------------
def test_128_row_tiles_cover_each_token_once_and_never_cross_chunks() -> None:
    lengths = [1, 15, 64, 65, 127, 128, 129, 200, 1000, 3]
    tiles = flash_plan.flash_tiles(lengths, WS_ROWS)
    assert tiles.dtype == np.int32 and np.all((tiles[:, 1] >= 1) & (tiles[:, 1] <= WS_ROWS))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    assert np.array_equal(np.concatenate([np.arange(f, f + c) for f, c in tiles]), np.arange(starts[-1]))
    for f, c in tiles:
        chunk_of = np.searchsorted(starts, f, side="right") - 1
        assert f + c <= starts[chunk_of + 1]
    assert len(tiles) == sum(-(-n // WS_ROWS) for n in lengths)
    fa2 = flash_plan.flash_tiles(lengths, flash_plan.FLASH_TILE)
    assert np.array_equal(flash_plan.flash_tiles(lengths), fa2)  # fa2 unchanged


def test_step_tables_carry_the_tiles_of_the_runners_kernel_through_padding() -> None:
    host = build_step(mixed_batch(), SPEC, CFG, "bf16", tile_rows=WS_ROWS)  # type: ignore[arg-type]
    assert host.tile_rows == WS_ROWS
    assert host.tables.tiles.tolist() == [[0, 1], [1, 70], [71, 1], [72, 2], [74, 1]]  # the 70-token chunk: 1 tile
    assert host.tables.tiles_apart is not None and host.tables.tiles_apart.tolist() == [[1, 70], [72, 2]]
    assert build_step(mixed_batch(), SPEC, CFG, "bf16").tables.tiles.tolist()[1:3] == [[1, 64], [65, 6]]
    decode = build_step(StepBatch([chunk(0, 40, 1), chunk(2, 90, 1)]), SPEC, CFG, "bf16",  # type: ignore[arg-type]
                        tile_rows=WS_ROWS)
    padded = pad_step(decode, 4, 30, scratch_block=63, block_size=16, scratch_slot=5)
    assert padded.tile_rows == WS_ROWS
    assert padded.tables.tiles.tolist() == flash_plan.flash_tiles([1, 1, 16, 12], WS_ROWS).tolist()


def test_the_runner_builds_its_steps_for_its_models_kernel() -> None:
    r = CudaRunner.__new__(CudaRunner)
    r.cfg, r.dtype, r.spec = CFG, "bf16", SPEC
    assert r._prepare(mixed_batch()).tables.tiles.tolist()[1:3] == [[1, 64], [65, 6]]  # class default: fa2's
    r.flash_tile_rows = WS_ROWS
    assert r._prepare(mixed_batch()).tables.tiles.tolist()[1] == [1, 70]
    src = Path(ops.__file__).with_name("runner.py").read_text()
    assert "self.flash_tile_rows = self.model.flash_tile_rows" in src  # one resolution for both (CudaRunner init)


# ---- launches ------------------------------------------------------------------------------------------------
class Hopper:
    info = SimpleNamespace(sm_count=132, arch="sm_90")

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def launch(self, family, name, grid, block, *args, shmem=0, stream=None):
        self.calls.append((family, name, grid, block, shmem, len(args)))


def test_launch_grid_threads_and_shared_memory() -> None:
    ctx = SimpleNamespace(device=Hopper())
    ops.flash_prefill(ctx, *flash_args(), variant="ws")
    ops.flash_prefill(ctx, *flash_args())
    ws, fa2 = ctx.device.calls
    assert ws == ("flash_prefill_ws", "flash_prefill_ws_bf16_hd256", (8, 3), 384, 229_376, fa2[5])  # same args
    assert fa2[:5] == ("flash_prefill", "flash_prefill_bf16_hd256", (8, 3), 128, flash_plan.flash_shared_bytes(256))


def test_ws_is_refused_where_its_kernel_does_not_apply() -> None:
    ctx = SimpleNamespace(device=Hopper())
    with pytest.raises(ShapeError, match="head_dim 256"):
        ops.flash_prefill(ctx, *flash_args(hd=128), variant="ws")
    with pytest.raises(ShapeError, match="variant must be"):
        ops.flash_prefill(ctx, *flash_args(), variant="fa3")
    args = list(flash_args())
    args[6], args[7] = arr((10, 16, 2, 256), "u8"), arr((10, 16, 2, 256), "u8")
    with pytest.raises(ShapeError, match="bf16 cache"):
        ops.flash_prefill(ctx, *args, k_scale=arr((10, 16, 2), "f32"), v_scale=arr((10, 16, 2), "f32"),
                          variant="ws")
    ampere = SimpleNamespace(device=SimpleNamespace(info=SimpleNamespace(arch="sm_80"), launch=None))
    with pytest.raises(ShapeError, match="sm_90"):
        ops.flash_prefill(ampere, *flash_args(), variant="ws")
    assert not ctx.device.calls


def test_the_attention_layer_launches_the_models_variant(monkeypatch) -> None:
    import tests.cuda_runner.test_decode_rows_apart as rows_apart

    class HopperLog(rows_apart.LaunchLog):
        def __init__(self) -> None:
            super().__init__()
            self.device.info.arch = "sm_90"

    monkeypatch.setattr(rows_apart, "LaunchLog", HopperLog)
    orig = rows_apart.CudaTextModel.__init__

    def ws_model(self, *a, **k):
        orig(self, *a, **k)
        self.flash_variant = "ws"

    monkeypatch.setattr(rows_apart.CudaTextModel, "__init__", ws_model)
    for apart, tiles in ((False, "tiles"), (True, "tiles_apart")):
        calls, m, _ = _attention_launches(apart=apart)
        flash = [c for c in calls if c[0].startswith("flash_prefill")]
        assert [c[0] for c in flash] == ["flash_prefill_ws_bf16_hd256"]
        assert flash[0][1][1] == 384 and flash[0][1][2 + 12] == getattr(m, tiles).ptr


# ---- tile bookkeeping (numpy emulation) ----------------------------------------------------------------------
def emulate(case, **kwargs) -> np.ndarray:
    tiles = flash_plan.flash_tiles([n for _, n in case.seqs], WS_ROWS)
    return flash_prefill_ws_emulated(case.q, case.gate, case.cache_k, case.cache_v, case.tables, case.token_seq,
                                     case.token_pos, tiles, case.heads, case.kv_heads, case.scale, **kwargs)


BOOKKEEPING = [  # (heads, kv_heads, block_size, seqs): fresh, continued, varlen, counts < 128, bs 24 (not 2^k)
    (4, 1, 16, [(0, 200)]),
    (4, 1, 64, [(300, 200)]),
    (6, 1, 16, [(0, 1), (37, 15), (0, 64), (129, 130), (5, 77)]),
    (4, 1, 24, [(63, 65), (0, 128), (2048 - 100, 100)]),
]


@pytest.mark.parametrize("heads,kv_heads,bs,seqs", BOOKKEEPING)
def test_emulated_ws_schedule_matches_the_reference(heads, kv_heads, bs, seqs) -> None:
    case = make_case(np.random.default_rng(), heads, kv_heads, 256, bs, seqs)
    trace = WsTrace()
    err = rel_err(emulate(case, trace=trace), expected(case))
    assert err <= 1e-2, err
    n = case.token_seq.size
    assert sorted(trace.stored_rows) == list(range(n))  # every real row stored once, none past a tile's count
    tiles = flash_plan.flash_tiles([m for _, m in case.seqs], WS_ROWS)
    for t, (first, count) in enumerate(tiles):
        p_last = int(case.token_pos[first + count - 1])
        assert trace.copied[t] == p_last // BN + 1 and trace.max_key[t] == p_last  # causal skip: nothing beyond
        for c in range(2):
            real = case.token_pos[first + 64 * c : first + min(count, 64 * (c + 1))]
            assert trace.computed[(t, c)] == (0 if real.size == 0 else int(real[-1]) // BN + 1)


def test_the_bookkeeping_has_teeth() -> None:
    case = make_case(np.random.default_rng(), 2, 1, 256, 16, [(10, 256)])  # tiles not aligned to key tiles
    want = expected(case)
    assert rel_err(emulate(case, apply_mask=False), want) > 0.1  # future keys visible
    first_row = lambda pos, c: 0 if pos[64 * c : 64 * (c + 1)].size == 0 else int(pos[64 * c]) // BN + 1  # noqa
    assert rel_err(emulate(case, computed_tiles=first_row), want) > 0.05  # a warpgroup stopping at its first row
    assert warpgroup_tiles(np.arange(100, 160), 1) == 0 and warpgroup_tiles(np.arange(100, 228), 0) == 163 // BN + 1


# ---- the K / V rings (mbarrier protocol replay) --------------------------------------------------------------
class Barrier:
    """An mbarrier: `expected` arrivals complete a phase; a parity wait passes once the phase of that parity has
    completed (the current phase's parity differs), as try_wait.parity / test_wait.parity compare."""

    def __init__(self, expected: int) -> None:
        self.expected, self.pending, self.phase = expected, expected, 0

    def arrive(self) -> None:
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.expected

    def passed(self, parity: int) -> bool:
        return (self.phase & 1) != parity


def replay(n_kt: int, computed: list[int], stages: tuple[int, int], seed: int, *, drain: bool = True,
           release_before_retire: bool = False, pass_without_wait: bool = False, tracked: bool = False) -> list[str]:
    """fw_produce / fw_consume's protocol, one actor per warpgroup, interleaved at random. Ring 0 is K, ring 1 V.
    A copy (group) is in a stage from its issue, usable once handed over (full arrive); a consumer's MMA reads a
    stage from its issue until it retires. computed[c]: key tiles consumer c computes (the rest pass through).
    Returns what went wrong: an MMA on a stage not holding its landed tile, a copy over a stage an MMA still
    reads, or a deadlock. The flags break the kernel's rules, for the tests' teeth. tracked: ws2's producer, whose
    groups are handed over by cp.async.mbarrier.arrive when they land (in issue order, at any later moment: a lander
    actor), never by the producer itself, which only waits for empty stages."""
    full = [[Barrier(1) for _ in range(s)] for s in stages]
    empty = [[Barrier(len(computed)) for _ in range(s)] for s in stages]
    occupant: dict[tuple[int, int], tuple[int, bool]] = {}  # (ring, stage) -> (tile, handed over)
    in_use: dict[tuple[int, int], set[int]] = {}  # (ring, stage) -> consumers whose MMA reads it
    bad: list[str] = []

    def where(ring: int, tile: int) -> tuple[int, int]:
        return ring, tile % stages[ring]

    landing: list[tuple[int, int]] = []  # tracked: issued groups not yet landed, oldest first
    issued_all = [False]

    def producer_tracked():
        for grp in range(2 * n_kt):
            tile, ring = grp >> 1, grp & 1
            st = where(ring, tile)
            if tile >= stages[ring]:
                while not empty[ring][st[1]].passed((tile // stages[ring] - 1) & 1):
                    yield False
            if in_use.get(st):
                bad.append(f"tile {tile} of ring {ring} copied over stage {st[1]} read by {sorted(in_use[st])}")
            occupant[st] = (tile, False)
            landing.append(st)
            yield True
        issued_all[0] = True

    def lander():
        while not (issued_all[0] and not landing):
            if not landing:
                yield False
                continue
            st = landing.pop(0)
            occupant[st] = (occupant[st][0], True)
            full[st[0]][st[1]].arrive()
            yield True

    def producer():
        pending = None
        for grp in range(2 * n_kt):
            tile, ring = grp >> 1, grp & 1
            st = where(ring, tile)
            if tile >= stages[ring]:
                parity = (tile // stages[ring] - 1) & 1
                if drain and pending is not None and not empty[ring][st[1]].passed(parity):
                    occupant[pending] = (occupant[pending][0], True)
                    full[pending[0]][pending[1]].arrive()
                    pending = None
                while not empty[ring][st[1]].passed(parity):
                    yield False
            if in_use.get(st):
                bad.append(f"tile {tile} of ring {ring} copied over stage {st[1]} read by {sorted(in_use[st])}")
            occupant[st] = (tile, False)
            yield True
            if pending is not None:
                occupant[pending] = (occupant[pending][0], True)
                full[pending[0]][pending[1]].arrive()
                yield True
            pending = st
        occupant[pending] = (occupant[pending][0], True)
        full[pending[0]][pending[1]].arrive()

    def wait_full(ring: int, tile: int):
        st = where(ring, tile)
        while not full[ring][st[1]].passed((tile // stages[ring]) & 1):
            yield False

    def issue(c: int, ring: int, tile: int) -> None:
        st = where(ring, tile)
        if occupant.get(st) != (tile, True):
            bad.append(f"consumer {c}: MMA on tile {tile} of ring {ring}, stage {st[1]} holds {occupant.get(st)}")
        in_use.setdefault(st, set()).add(c)

    def retire(c: int, ring: int, tile: int) -> None:
        in_use[where(ring, tile)].discard(c)

    def release(ring: int, tile: int) -> None:
        empty[ring][tile % stages[ring]].arrive()

    def consumer(c: int):
        n_c = computed[c]
        if n_c:
            yield from wait_full(0, 0)
            issue(c, 0, 0)
            yield True
            retire(c, 0, 0)
            release(0, 0)
            for j in range(1, n_c):
                yield from wait_full(0, j)
                issue(c, 0, j)                       # S_j
                yield True
                yield from wait_full(1, j - 1)
                issue(c, 1, j - 1)                   # O += P_{j-1} V_{j-1}
                if release_before_retire:
                    release(1, j - 1)
                yield True
                retire(c, 0, j)                      # wait<1>: S_j retired
                release(0, j)
                yield True                           # softmax
                retire(c, 1, j - 1)                  # wait<0>
                if not release_before_retire:
                    release(1, j - 1)
                yield True
            yield from wait_full(1, n_c - 1)
            issue(c, 1, n_c - 1)
            yield True
            retire(c, 1, n_c - 1)
            release(1, n_c - 1)
        for j in range(n_c, n_kt):                   # passed through
            for ring in (0, 1):
                if not pass_without_wait:
                    yield from wait_full(ring, j)
                release(ring, j)
                yield True

    rng = random.Random(seed)
    actors = ([producer_tracked(), lander()] if tracked else [producer()]) + [consumer(c) for c in range(len(computed))]
    blocked = 0
    while actors:
        i = rng.randrange(len(actors))
        try:
            progressed = next(actors[i])
        except StopIteration:
            del actors[i]
            blocked = 0
            continue
        blocked = 0 if progressed else blocked + 1
        if blocked > 50 * len(actors) + 200:  # every actor kept finding its barrier closed
            return bad + [f"deadlock (n_kt {n_kt}, computed {computed}, stages {stages})"]
    return bad


def computed_splits(n_kt: int) -> list[list[int]]:
    """(warpgroup 0, warpgroup 1) key-tile counts the kernel can give a tile of n_kt key tiles: a diagonal tile
    (warpgroup 0 one tile short, or the same), a tile with only warpgroup 0's rows, a lone row."""
    return [[n_kt, n_kt], [max(1, n_kt - 1), n_kt], [n_kt, 0], [1, 0] if n_kt == 1 else [n_kt - 1, n_kt]]


@pytest.mark.parametrize("stages", [flash_plan.FLASH_WS_STAGES, (1, 1), (2, 2), (3, 2), (1, 3)])
def test_the_rings_hold_under_random_interleavings(stages) -> None:
    for n_kt in range(1, 12):
        for computed in computed_splits(n_kt):
            for seed in range(12):
                assert replay(n_kt, computed, stages, seed) == [], (n_kt, computed, seed)


@pytest.mark.parametrize("stages", [flash_plan.FLASH_WS_STAGES, (1, 1), (2, 2), (1, 3)])
def test_the_ws2_rings_hold_with_hand_over_at_landing(stages) -> None:
    for n_kt in range(1, 12):
        for computed in computed_splits(n_kt):
            for seed in range(12):
                assert replay(n_kt, computed, stages, seed, tracked=True) == [], (n_kt, computed, seed)


def test_the_ws2_replay_has_teeth() -> None:
    splits = [(n, c) for n in range(2, 9) for c in computed_splits(n)]
    assert any(replay(n, c, flash_plan.FLASH_WS_STAGES, s, release_before_retire=True, tracked=True) for n, c in splits
               for s in range(30))
    assert any(replay(n, [n, 1], (1, 1), s, pass_without_wait=True, tracked=True) for n in range(3, 9)
               for s in range(30))


def test_the_replay_has_teeth() -> None:
    splits = [(n, c) for n in range(2, 9) for c in computed_splits(n)]
    # without handing over the group in flight before blocking, one V stage deadlocks (V_t waits for the release
    # of V_{t-1}, whose step needs K_t, which the producer holds)
    assert any("deadlock" in " ".join(replay(n, c, (2, 1), s, drain=False)) for n, c in splits for s in range(6))
    # releasing V_{j-1} while its P V still reads it lets the producer copy over it
    assert any(replay(n, c, flash_plan.FLASH_WS_STAGES, s, release_before_retire=True) for n, c in splits
               for s in range(30))
    # a passing warpgroup releasing before the stage is filled completes a phase for the wrong tile
    assert any(replay(n, [n, 1], (1, 1), s, pass_without_wait=True) for n in range(3, 9) for s in range(30))


def test_pass_through_keeps_every_release_of_the_kernel() -> None:
    """The kernel's consumer source: each computing step releases K_j after wait<1> and V_{j-1} after wait<0>, and
    the pass-through loop waits for full before each release (what the replay assumes)."""
    src = SOURCE.read_text()
    loop = src[src.index("for (int j = 1; j < n_c; ++j)"):]
    order = ["issue_qk(j)", "issue_pv(j - 1)", "vw_wait<1>()", "k_empty + k_stage(j)", "vw_wait<0>()",
             "v_empty + v_stage(j - 1)"]
    at = [loop.index(x) for x in order]
    assert at == sorted(at)
    passing = src[src.index("for (int j = n_c; j < n_kt; ++j)"):]
    passing = passing[: passing.index("if (rows <= 0) return;")]
    steps = ["k_full + k_stage(j)", "k_empty + k_stage(j)", "v_full + v_stage(j)", "v_empty + v_stage(j)"]
    at = [passing.index(x) for x in steps]
    assert at == sorted(at)



# ---- ws2 (flash_prefill_ws2_bf16_hd256, the same file's second entry) -----------------------------------------
def test_ws2_is_an_option_resolved_like_ws_and_launches_its_own_entry() -> None:
    assert CudaOptions(flash_prefill="ws2").flash_prefill == "ws2"
    assert CudaOptions.from_env({"DOCPIPE_CUDA_FLASH_PREFILL": "ws2"}).flash_prefill == "ws2"
    assert flash_plan.FLASH_TILE_ROWS["ws2"] == WS_ROWS
    assert flash_plan.flash_variant("ws2", 256, False, "sm_90") == "ws2"
    assert [flash_plan.flash_variant("ws2", *a) for a in ((256, True, "sm_90"), (128, False, "sm_90"),
                                                   (256, False, "sm_80"))] == ["fa2"] * 3
    ctx = SimpleNamespace(device=Hopper())
    ops.flash_prefill(ctx, *flash_args(), variant="ws2")
    ops.flash_prefill(ctx, *flash_args(), variant="ws")
    ws2, ws = ctx.device.calls
    assert ws2 == ("flash_prefill_ws", "flash_prefill_ws2_bf16_hd256", *ws[2:])
    ampere = SimpleNamespace(device=SimpleNamespace(info=SimpleNamespace(arch="sm_80"), launch=None))
    with pytest.raises(ShapeError, match="'ws2' needs"):
        ops.flash_prefill(ampere, *flash_args(), variant="ws2")


def test_ws2_source_keeps_its_order() -> None:
    """Both entries instantiate one template; ws2's consumer rescales O between S_j's issue and P V_{j-1}'s (ws after
    the wait), fences after every full wait it computes on, and its producer hands over by the tracked arrival."""
    src = SOURCE.read_text()
    assert re.search(r"flash_prefill_ws_bf16_hd256\(FW_PARAMS\) \{\s+fw_kernel<false>", src)
    assert re.search(r"flash_prefill_ws2_bf16_hd256\(FW_PARAMS\) \{\s+fw_kernel<true>", src)
    loop = src[src.index("for (int j = 1; j < n_c; ++j)"):]
    order = ["issue_qk(j)", "if (WS2) rescale_o();", "issue_pv(j - 1)", "vw_wait<1>()", "vw_wait<0>()",
             "v_empty + v_stage(j - 1)", "if (!WS2) rescale_o();", "vw_pack_p(s, pf)",
             "if (WS2) rescale_o();   // O to the last", "issue_pv(n_c - 1)"]
    at = [loop.index(x) for x in order]
    assert at == sorted(at)
    consume = src[src.index("__device__ __forceinline__ void fw_consume("):src.index("// key tiles past this")]
    assert "mbar_wait(" not in consume.replace("mbar_wait(bar, parity);", "")  # every wait fences (WS2)
    produce = src[src.index("__device__ __forceinline__ void fw_produce("):src.index("// Consumer warpgroup c")]
    assert produce.index("fw_cp_async_arrive(full)") < produce.index("cp_async_commit()")
    assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in src
