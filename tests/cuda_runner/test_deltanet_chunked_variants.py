"""Host-side checks of the chunked gated delta rule's variants (no GPU): the option and its environment variable,
the launcher's refusal of an unknown variant before any launch, and what each variant launches (kernels, grids,
dynamic shared memory, arena use)."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_engine.cuda import deltanet_chunked as dc
from gpu_engine.cuda.arena import Arena
from gpu_engine.cuda.context import DArray
from gpu_engine.cuda.device import KERNEL_DIR
from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.options import CudaOptions
from tests.cuda_runner.no_launch import arr, no_launch_ctx

KH, VH, DK, DV = 16, 32, 128, 128
LENS = (1, 130, 64)  # three sequences: 1 + 3 + 1 chunks
N = sum(LENS)
STRIDE = 2 * KH * DK + VH * DV
SM_SHARED = 228 * 1024  # H100/H200 shared memory per SM; each block also takes 1 KiB of it


def _args(**over):
    args = dict(out=arr((N, VH * DV)), q=arr((N, STRIDE)), k=arr((N, STRIDE)), v=arr((N, STRIDE)),
                qkv_stride=STRIDE, a=arr((N, 2 * VH)), b=arr((N, 2 * VH)), ab_stride=2 * VH,
                A_log=arr((VH,), "f32"), dt_bias=arr((VH,), "f32"), state=arr((4, VH, DV, DK), "f32"),
                cu_seqlens=arr((len(LENS) + 1,), "i32"), state_slots=arr((len(LENS),), "i32"),
                fresh=arr((len(LENS),), "i32"), k_heads=KH, v_heads=VH, dk=DK, dv=DV)
    args.update(over)
    return args


class LaunchLog:
    info = SimpleNamespace(sm_count=132)

    def __init__(self) -> None:
        self.launches: list[tuple[str, str, tuple, int]] = []

    def launch(self, family, name, grid, block, *args, shmem=0, stream=None):
        self.launches.append((name, tuple(grid), block, shmem))


def _logging_ctx() -> SimpleNamespace:
    arena = Arena(base=1 << 30, capacity=4 << 30)
    ctx = SimpleNamespace(device=LaunchLog(), arena=arena)
    ctx.empty = lambda shape, dtype, name: DArray(arena.alloc(DArray(0, tuple(shape), dtype).nbytes, name),
                                                  tuple(shape), dtype)
    return ctx


def test_option_defaults_to_states_and_reads_the_environment() -> None:
    assert CudaOptions().deltanet_chunked == "states" == dc.DEFAULT_VARIANT
    assert CudaOptions.from_env({}).deltanet_chunked == "states"
    assert CudaOptions.from_env({"DOCPIPE_CUDA_DELTANET_CHUNKED": ""}).deltanet_chunked == "states"
    assert CudaOptions.from_env({"DOCPIPE_CUDA_DELTANET_CHUNKED": "current"}).deltanet_chunked == "current"
    assert CudaOptions(deltanet_chunked="current").deltanet_chunked == "current"


def test_option_refuses_an_unknown_variant_by_name() -> None:
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_DELTANET_CHUNKED.*current, states.*'fast'"):
        CudaOptions.from_env({"DOCPIPE_CUDA_DELTANET_CHUNKED": "fast"})
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_DELTANET_CHUNKED"):
        CudaOptions(deltanet_chunked="State")


def test_launcher_refuses_an_unknown_variant_before_any_launch() -> None:
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_DELTANET_CHUNKED"):
        dc.chunked_gated_delta_rule(no_launch_ctx(), **_args(), variant="fast")


def _run(variant: str, dv_slice: int | None = None) -> tuple[list, list[str], SimpleNamespace]:
    ctx = _logging_ctx()
    phases: list[str] = []
    dc.chunked_gated_delta_rule(ctx, **_args(), dv_slice=dv_slice, variant=variant, on_launch=phases.append)
    return ctx.device.launches, phases, ctx


def test_current_variant_launches_prep_then_scan() -> None:
    launches, phases, ctx = _run("current")
    slots = dc.chunk_slots(N, len(LENS))
    assert launches == [("gdn_chunk_prep_dk128_dv128", (slots, VH), 128, 0),
                        ("gdn_chunk_scan_dk128_dv128", (DV // 32, VH, len(LENS)), 128, 0)]
    assert phases == ["prep", "scan"]
    assert ctx.arena.used == 0  # the intermediates go back to the arena


@pytest.mark.parametrize("dv_slice, states_kernel", [(32, "gdn_chunk_states_dk128_dv128"),
                                                     (16, "gdn_chunk_states16_dk128_dv128")])
def test_states_variant_launches_prep_states_output(dv_slice, states_kernel) -> None:
    launches, phases, ctx = _run("states", dv_slice)
    slots = dc.chunk_slots(N, len(LENS))
    assert launches == [
        ("gdn_chunk_prep_dk128_dv128", (slots, VH), 128, 0),
        (states_kernel, (DV // dv_slice, VH, len(LENS)), 128, dc.states_shared_bytes(DK, dv_slice)),
        ("gdn_chunk_output_dk128_dv128", (slots, VH), 128, dc.output_shared_bytes(DK, DV)),
    ]
    assert phases == ["prep", "states", "output"]
    assert ctx.arena.used == 0


def test_states_variant_shared_memory_and_workspace() -> None:
    # GsLayout / GoLayout in the kernel, worked out by hand: rows of dk + 8 / C + 8 / slice + 8 bf16
    assert dc.states_shared_bytes(128, 32) == 2 * (2 * (64 * 136 + 128 * 72 + 64 * 40) + 32 * 136 + 32 * 72) == 95232
    assert dc.states_shared_bytes(128, 16) == 84480
    assert dc.output_shared_bytes(128, 128) == 2 * (64 * 136 + 64 * 72 + 128 * 136 + 128 * 72) == 79872
    # two states blocks per SM at either width (the slice rule counts on 2 x 132 resident blocks), one output block
    # within the 227 KiB a block may take
    for width in (16, 32):
        assert 2 * (dc.states_shared_bytes(128, width) + 1024) <= SM_SHARED
    assert dc.output_shared_bytes(128, 128) <= 227 * 1024
    # Sc [dv, dk] and V'^T [dv, C] in bf16 on top of the current variant's per slot and head
    extra = dc.workspace_bytes(8192, 1, 32, 128, 128, "states") - dc.workspace_bytes(8192, 1, 32, 128, 128,
                                                                                      "current")
    assert extra == dc.chunk_slots(8192, 1) * 32 * 2 * 128 * (128 + 64)
    with pytest.raises(ShapeError, match="DOCPIPE_CUDA_DELTANET_CHUNKED"):
        dc.workspace_bytes(64, 1, 1, 128, 128, "fast")


def _layout_bytes(struct: str, **params: int) -> int:
    """BYTES of a layout struct of kernels/deltanet_chunked.cu, its constexpr lines evaluated in order with the
    template parameters and the file's #defines."""
    src = (Path(KERNEL_DIR) / "deltanet_chunked.cu").read_text()
    env: dict[str, int] = {name: int(v) for name, v in re.findall(r"#define (GC_\w+) (\d+)", src)} | params
    body = re.search(rf"struct {struct} {{(.*?)\n}};", src, re.S)
    assert body is not None, struct
    for decl in re.findall(r"static constexpr int (.*?);", body.group(1)):
        for part in decl.split(", "):
            name, expr = part.split(" = ")
            env[name] = eval(expr, {}, dict(env))  # integer arithmetic on the names above: nothing else is in scope
    return env["BYTES"]


@pytest.mark.parametrize("dk,dv", dc.HEAD_DIMS)
def test_host_shared_memory_matches_the_kernels_layouts(dk: int, dv: int) -> None:
    # the kernels do not check their dynamic shared memory: the host's count must be the layout's own
    assert re.findall(r"#define GC_C (\d+)", (Path(KERNEL_DIR) / "deltanet_chunked.cu").read_text()) == [str(dc.CHUNK)]
    for width in (dc.DV_SLICE, dc.NARROW_DV_SLICE):
        assert dc.states_shared_bytes(dk, width) == _layout_bytes("GsLayout", DK=dk, SLICE=width)
    assert dc.output_shared_bytes(dk, dv) == _layout_bytes("GoLayout", DK=dk, DV=dv)
