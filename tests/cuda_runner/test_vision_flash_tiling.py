"""The vision flash attention's tiling (emulated in numpy, tests/cuda_runner/vision_flash_emulation.py) against float64
segment attention, the launcher's argument checks and grid, the host constants against the kernel source, and the
tower's dispatch (auto -> flash in bf16 only). Runs without a GPU; check_vision_flash runs the kernel itself."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda import vision_flash
from gpu_engine.cuda.bf16 import round_to_bf16
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.errors import ShapeError
from tests.cuda_runner.harness import rel_err
from tests.cuda_runner.no_launch import arr, no_launch_ctx
from tests.cuda_runner.vision_flash_emulation import segment_attention_f64, vision_flash_emulated

KERNEL = Path(vision_flash.__file__).parent / "kernels" / "vision_flash.cu"


@pytest.fixture()
def rng() -> np.random.Generator:
    return np.random.default_rng()


def random_qkv(rng: np.random.Generator, n: int, heads: int, head_dim: int, spread: float = 1.5) -> np.ndarray:
    """bf16-valued q | k | v rows; `spread` > 1 makes the softmax peaky enough that a wrong max or mask shows."""
    q = spread * rng.standard_normal((n, heads * head_dim))
    k = spread * rng.standard_normal((n, heads * head_dim))
    v = rng.standard_normal((n, heads * head_dim))
    return round_to_bf16(np.concatenate([q, k, v], axis=1).astype(np.float32))


@pytest.mark.parametrize("variant", sorted(vision_flash.VARIANTS))
@pytest.mark.parametrize("head_dim", vision_flash.HEAD_DIMS)
@pytest.mark.parametrize("seg_len,segments", [(1, 5), (17, 3), (64, 2), (100, 3), (130, 2)])
def test_emulated_tiling_matches_float64_attention(rng, head_dim, seg_len, segments, variant) -> None:
    heads = 3
    qkv = random_qkv(rng, seg_len * segments, heads, head_dim)
    scale = head_dim ** -0.5
    got = vision_flash_emulated(qkv, heads, head_dim, seg_len, scale, variant=variant)
    assert np.all(np.isfinite(got))
    err = rel_err(got, segment_attention_f64(qkv, heads, head_dim, seg_len, scale))
    assert err <= 1e-2, f"hd {head_dim} seg {seg_len} {variant}: {err:.2e}"


def test_emulated_long_segment(rng) -> None:
    """1024 keys: 16 key steps of online softmax, 16 query tiles."""
    qkv = random_qkv(rng, 1024, 2, 72)
    err = rel_err(vision_flash_emulated(qkv, 2, 72, 1024, 72 ** -0.5), segment_attention_f64(qkv, 2, 72, 1024,
                                                                                             72 ** -0.5))
    assert err <= 1e-2


def test_without_the_tail_mask_the_emulation_is_wrong(rng) -> None:
    """The check has teeth: zero-filled keys past the segment end left unmasked (score 0) change the result."""
    qkv = random_qkv(rng, 2 * 70, 2, 72)  # the second key tile of each segment holds 6 keys and 58 zero rows
    err = rel_err(vision_flash_emulated(qkv, 2, 72, 70, 72 ** -0.5, mask_tail=False),
                  segment_attention_f64(qkv, 2, 72, 70, 72 ** -0.5))
    assert err > 0.05


def test_padded_k_columns_must_be_zero(rng) -> None:
    """Q's pad is zero, but 0 * NaN is NaN: garbage in K's padded columns would poison every score."""
    qkv = random_qkv(rng, 20, 1, 72)
    assert not np.all(np.isfinite(vision_flash_emulated(qkv, 1, 72, 20, 0.1, pad_with=np.nan)))
    assert np.all(np.isfinite(vision_flash_emulated(qkv, 1, 72, 20, 0.1)))


def test_host_constants_match_the_kernel_source() -> None:
    src = KERNEL.read_text()
    define = lambda name: int(re.search(rf"#define {name} (\d+)", src).group(1))
    assert define("VF_ROWS") == vision_flash.TILE_ROWS and define("VF_BN") == vision_flash.KEYS_PER_STEP
    assert define("VF_THREADS") == 128
    pad = define("VF_PAD")
    assert "HDP = (HD + 15) / 16 * 16" in src and "SMEM_BYTES = 2 * 4 * KV_TILE" in src
    assert tuple(int(h) for h in re.findall(r"^DEFINE\((\d+), \d\)$", src, re.MULTILINE)) == vision_flash.HEAD_DIMS
    m2 = {(int(h), int(k)) for h, k in re.findall(r"^DEFINE2\((\d+), (\d+), \d\)$", src, re.MULTILINE)}
    mma_sync = {v: mk for v, mk in vision_flash.VARIANTS.items() if v not in vision_flash.HOPPER_VARIANTS}
    keys = {k for m, k in mma_sync.values() if m == 2}
    assert m2 == {(hd, k) for hd in vision_flash.M2_HEAD_DIMS for k in keys}
    assert all(m in (1, 2) for m, _ in mma_sync.values())  # the kernel instantiates MT 1 and 2
    for hd in vision_flash.HEAD_DIMS:
        assert hd % 8 == 0  # 16-byte row pieces; V is never padded
        assert vision_flash.shared_bytes(hd) == 2 * 4 * vision_flash.KEYS_PER_STEP * (
            vision_flash.padded_head_dim(hd) + pad)
        assert 2 * vision_flash.shared_bytes(hd) <= 227 * 1024
    assert vision_flash.padded_head_dim(72) == 80 and vision_flash.padded_head_dim(64) == 64
    assert vision_flash.shared_bytes(72) <= 48 * 1024  # hd 72 needs no raised shared-memory limit


def test_wgmma_kernel_constants_match_the_host() -> None:
    src = (KERNEL.parent / "vision_flash_wg.cu").read_text()
    define = lambda name: int(re.search(rf"#define {name} (\d+)", src).group(1))
    assert define("VW_THREADS") == vision_flash.WG_THREADS == 256
    assert define("VW_ROWS") == vision_flash.tile_rows("wg64") and define("VW_BN") == vision_flash.VARIANTS["wg64"][1]
    assert (define("VW_HD"),) == vision_flash.WG_HEAD_DIMS
    # two stages of K (80 columns, pad included) + V (72 columns), 64 rows each, no row padding
    assert "SMEM_BYTES = 2 * STAGE" in src and vision_flash.wg_shared_bytes(72) == 2 * 64 * (80 + 72) * 2 == 38912
    assert vision_flash.wg_shared_bytes(72) <= 48 * 1024  # no raised shared-memory limit; two blocks fit an SM


class RecordingDevice:
    info = SimpleNamespace(sm_count=132)

    def __init__(self, arch: str | None = None) -> None:
        self.calls: list[tuple] = []
        if arch is not None:
            self.info = SimpleNamespace(sm_count=132, arch=arch)

    def launch(self, family, name, grid, block, *args, shmem=0, stream=None):
        self.calls.append((family, name, grid, block, [type(a).__name__ for a in args], shmem))


@pytest.mark.parametrize("n,seg,blocks", [(8192, 4096, 128), (51, 17, 3), (200, 100, 4), (5, 1, 5)])
def test_launch_grid_and_arguments(n, seg, blocks) -> None:
    ctx = SimpleNamespace(device=RecordingDevice())
    vision_flash.vision_flash_attention(ctx, arr((n, 16 * 72)), arr((n, 3 * 16 * 72)), 16, 72, seg, 72 ** -0.5,
                                        variant="m1")
    assert ctx.device.calls == [("vision_flash", "vision_flash_bf16_hd72", (blocks, 16), 128,
                                 ["int", "int", "int32", "int32", "int32", "float32"],
                                 vision_flash.shared_bytes(72))]


@pytest.mark.parametrize("variant,name,blocks,keys", [
    ("m2n32", "vision_flash_bf16_hd72_m2_n32", 64, 32), ("m2n64", "vision_flash_bf16_hd72_m2_n64", 64, 64)])
def test_two_m_tile_variants_launch_128_row_tiles(variant, name, blocks, keys) -> None:
    ctx = SimpleNamespace(device=RecordingDevice())
    n, seg = 8192, 4096  # 32 tiles of 128 rows per segment
    vision_flash.vision_flash_attention(ctx, arr((n, 16 * 72)), arr((n, 3 * 16 * 72)), 16, 72, seg, 72 ** -0.5,
                                        variant=variant)
    (call,) = ctx.device.calls
    assert call[1:3] == (name, (blocks, 16)) and call[5] == vision_flash.shared_bytes(72, keys)
    assert call[4] == ["int", "int", "int32", "int32", "int32", "float32"]


@pytest.mark.parametrize("arch,name,threads", [("sm_90", "vision_flash_wg_bf16_hd72_n64", 256),
                                               ("sm_80", "vision_flash_bf16_hd72_m2_n32", 128)])
def test_wgmma_variant_launch(arch, name, threads) -> None:
    ctx = SimpleNamespace(device=RecordingDevice(arch))
    n, seg = 8192, 4096  # 32 tiles of 128 rows per segment, either kernel
    vision_flash.vision_flash_attention(ctx, arr((n, 16 * 72)), arr((n, 3 * 16 * 72)), 16, 72, seg, 72 ** -0.5,
                                        variant="wg64")
    (call,) = ctx.device.calls
    family = "vision_flash_wg" if threads == 256 else "vision_flash"
    shmem = vision_flash.wg_shared_bytes(72) if threads == 256 else vision_flash.shared_bytes(72, 32)
    assert call == (family, name, (64, 16), threads, ["int", "int", "int32", "int32", "int32", "float32"], shmem)


def test_default_variant_and_fallback_to_m1() -> None:
    hopper = SimpleNamespace(device=RecordingDevice("sm_90"))
    vision_flash.vision_flash_attention(hopper, arr((200, 16 * 72)), arr((200, 3 * 16 * 72)), 16, 72, 100, 0.1)
    assert hopper.device.calls[-1][1] == vision_flash.kernel_name(72, vision_flash.DEFAULT_VARIANT)
    ctx = SimpleNamespace(device=RecordingDevice())  # no wgmma here: the default falls back to m2n32
    vision_flash.vision_flash_attention(ctx, arr((200, 16 * 72)), arr((200, 3 * 16 * 72)), 16, 72, 100, 0.1)
    assert ctx.device.calls[-1][1] == vision_flash.kernel_name(72, "m2n32")
    vision_flash.vision_flash_attention(ctx, arr((200, 4 * 128)), arr((200, 3 * 4 * 128)), 4, 128, 100, 0.1)
    assert ctx.device.calls[-1][1:3] == ("vision_flash_bf16_hd128", (4, 4))  # no m2 kernel at hd 128: 64-row tiles
    with pytest.raises(ShapeError, match="variant"):
        vision_flash.vision_flash_attention(ctx, arr((200, 16 * 72)), arr((200, 3 * 16 * 72)), 16, 72, 100, 0.1,
                                            variant="m3")


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=16), "head_dim"),
    (dict(head_dim=96), "head_dim"),
    (dict(dtype="f32"), "must be bf16"),
    (dict(seg=7), "must divide"),
    (dict(seg=0), "must divide"),
    (dict(out_cols=4 * 72 + 1), "qkv"),
    (dict(qkv_ptr=(1 << 20) + 8), "16-byte aligned"),
    (dict(scale=0.0), "scale"),
])
def test_bad_arguments_are_refused(kwargs, match) -> None:
    heads, hd, n = 4, kwargs.get("head_dim", 72), 20
    dtype = kwargs.get("dtype", "bf16")
    out = arr((n, kwargs.get("out_cols", heads * hd)), dtype)
    qkv = DArray(kwargs.get("qkv_ptr", 1 << 20), (n, 3 * heads * hd), dtype)
    with pytest.raises(ShapeError, match=match):
        vision_flash.vision_flash_attention(no_launch_ctx(), out, qkv, heads, hd, kwargs.get("seg", 10),
                                            kwargs.get("scale", 0.1))


def test_supported_only_in_bf16_with_an_instantiated_head_dim() -> None:
    assert vision_flash.supported("bf16", 72) and vision_flash.supported("bf16", 64)
    assert not vision_flash.supported("f32", 72)  # fp32 towers keep their exact paths
    assert not vision_flash.supported("bf16", 16)


def test_pipelined_wgmma_kernel_constants_match_the_host() -> None:
    src = (KERNEL.parent / "vision_flash_wg.cu").read_text()
    stages, q_rows = vision_flash.WG_STAGING["wg64p"]
    assert "vision_flash_wg_bf16_hd72_n64_p(" in src and f"vw_attention_pipelined<{stages}, true>(" in src
    assert vision_flash.WG_STAGING["wg64pr"] == (stages, 0)  # Q in registers
    assert "vision_flash_wg_bf16_hd72_n64_pr(" in src and f"vw_attention_pipelined<{stages}, false>(" in src
    assert "constexpr int SMEM = Q_BYTES + STAGES * S::STAGE" in src and "Q_BYTES = Q_SMEM ? S::Q_TILE : 0" in src
    assert q_rows == vision_flash.tile_rows("wg64p") == 128 and "Q_TILE = VW_ROWS / 8 * K_GROUP" in src
    shmem = vision_flash.wg_shared_bytes(72, 64, stages, q_rows)
    assert shmem == 128 * 80 * 2 + stages * 64 * (80 + 72) * 2 == 98304
    assert 2 * (shmem + 1024) <= 228 * 1024  # two blocks an SM (1 KiB reserved per block), as __launch_bounds__ asks
    assert vision_flash.wg_shared_bytes(72, 64, stages, 0) == 77824


def stage_ring_violations(n_kt: int, stages: int, dist: int) -> list[str]:
    """vw_attention_pipelined's copy / read schedule over n_kt key tiles, replayed: tile t is copied into stage
    t % stages in cp.async group t (prologue for t < dist, else after step t - dist's barrier); step j waits until at
    most dist - 1 groups are pending, then reads K_j (S_j, retired in step j) and V_{j-1} (P V, retired in step j;
    V of the last tile in the epilogue, after the loop). A barrier at the top of each step: a copy issued in step c
    may overwrite only a stage whose reads all retired in steps < c. Returns what goes wrong."""
    bad: list[str] = []
    occupant: dict[int, int] = {}  # stage -> tile copied into it
    last_read = {t: t + 1 for t in range(n_kt)}  # step whose P V read V_t (n_kt: the epilogue)
    groups: list[int] = []  # committed cp.async groups, by the tile they copy (-1: empty)

    def load(t: int, step: int) -> None:
        if t < n_kt:
            prev = occupant.get(t % stages)
            if prev is not None and last_read[prev] >= step:
                bad.append(f"tile {t} copied in step {step} over tile {prev}, still read in step {last_read[prev]}")
            occupant[t % stages] = t
        groups.append(t if t < n_kt else -1)

    for t in range(dist):
        load(t, -1)
    for j in range(n_kt):
        done = groups[: len(groups) - (dist - 1)]  # cp.async.wait_group dist - 1
        if j not in done or occupant.get(j % stages) != j:
            bad.append(f"step {j}: tile {j} not landed in stage {j % stages}")
        if j > 0 and occupant.get((j - 1) % stages) != j - 1:
            bad.append(f"step {j}: V of tile {j - 1} overwritten")
        load(j + dist, j)
    if n_kt and occupant.get((n_kt - 1) % stages) != n_kt - 1:
        bad.append("epilogue: V of the last tile overwritten")
    return bad


@pytest.mark.parametrize("n_kt", range(1, 13))
def test_pipelined_stage_ring_never_overwrites_a_tile_in_use(n_kt) -> None:
    stages = vision_flash.WG_STAGING["wg64p"][0]
    assert stage_ring_violations(n_kt, stages, stages - 2) == []  # the kernel's DIST = STAGES - 2
    if n_kt > stages:  # the check has teeth: one tile further ahead refills a stage P V still reads
        assert stage_ring_violations(n_kt, stages, stages - 1)


@pytest.mark.parametrize("variant,arch,name,threads,shmem", [
    ("wg64p", "sm_90", "vision_flash_wg_bf16_hd72_n64_p", 256, 98304),
    ("wg64pr", "sm_90", "vision_flash_wg_bf16_hd72_n64_pr", 256, 77824),
    ("wg64p", "sm_80", "vision_flash_bf16_hd72_m2_n32", 128, vision_flash.shared_bytes(72, 32))])
def test_pipelined_wgmma_variant_launch(variant, arch, name, threads, shmem) -> None:
    ctx = SimpleNamespace(device=RecordingDevice(arch))
    vision_flash.vision_flash_attention(ctx, arr((8192, 16 * 72)), arr((8192, 3 * 16 * 72)), 16, 72, 4096,
                                        72 ** -0.5, variant=variant)
    (call,) = ctx.device.calls
    assert call[1:4] == (name, (64, 16), threads) and call[5] == shmem
