"""gemm.py's epilogue arguments (bias / act) and plan logic, without a GPU or nvmath.

cuBLASLt is replaced by a recorder that keeps the order of descriptor attributes and heuristic queries; what it
cannot show is cuBLASLt's arithmetic (tests/cuda_runner/check_kernels.py's "gemm ... +bias" rows do that on a GPU).
"""
from __future__ import annotations

import enum
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_engine.cuda.errors import ShapeError
from gpu_engine.cuda.gemm import CublasLt, EpilogueUnsupported, GemmKey, epilogue_name

BASE = 1 << 32


class _Attr(enum.IntEnum):
    TRANSA, TRANSB, EPILOGUE, BIAS_POINTER = 3, 4, 5, 8


class _Epi(enum.IntEnum):
    DEFAULT, BIAS, GELU, GELU_BIAS = 1, 4, 32, 36


class RecordingLt:
    """The handful of cublasLt bindings gemm.py calls; `found` is what the heuristic answers."""

    MatmulDescAttribute, Epilogue = _Attr, _Epi
    MatmulPreferenceAttribute = SimpleNamespace(MAX_WORKSPACE_BYTES=1)
    MatrixLayoutAttribute = int
    matmul_heuristic_result_dtype = np.dtype([("algo", np.uint8, 64)])

    def __init__(self, found: int = 1) -> None:
        self.found, self.log, self._next = found, [], 100

    def _new(self, what: str) -> int:
        self._next += 1
        self.log.append(("create", what, self._next))
        return self._next

    def matmul_desc_create(self, compute, scale) -> int:
        return self._new("desc")

    def matrix_layout_create(self, dtype, rows, cols, ld) -> int:
        return self._new("layout")

    def matmul_preference_create(self) -> int:
        return self._new("pref")

    def get_matmul_desc_attribute_dtype(self, attr):
        return np.int64

    get_matrix_layout_attribute_dtype = get_matmul_preference_attribute_dtype = get_matmul_desc_attribute_dtype

    def matmul_desc_set_attribute(self, desc, attr, ptr, nbytes) -> None:
        value = int(np.ctypeslib.ctypes.c_int64.from_address(ptr).value)
        self.log.append(("desc_set", desc, _Attr(attr).name, value))

    def matrix_layout_set_attribute(self, *args) -> None:
        pass

    def matmul_preference_set_attribute(self, *args) -> None:
        pass

    def MatmulHeuristicResult(self, wanted: int) -> SimpleNamespace:  # noqa: N802 - the binding's name
        buf = np.zeros(max(wanted, 1) * 64, np.uint8)
        return SimpleNamespace(buf=buf, ptr=buf.ctypes.data)

    def matmul_algo_get_heuristic(self, handle, desc, a, b, c, d, pref, wanted, results, count_ptr) -> None:
        self.log.append(("heuristic", desc))
        (np.ctypeslib.ctypes.c_int32).from_address(count_ptr).value = self.found

    def matmul_preference_destroy(self, pref) -> None:
        pass

    def matrix_layout_destroy(self, layout) -> None:
        self.log.append(("destroy", layout))

    def matmul_desc_destroy(self, desc) -> None:
        self.log.append(("destroy", desc))

    def matmul(self, handle, desc, alpha, a, al, b, bl, beta, c, cl, d, dl, algo, ws, wsb, stream) -> None:
        self.log.append(("matmul", desc, float(np.ctypeslib.ctypes.c_float.from_address(beta).value), c, d))


def recording_blas(found: int = 1) -> tuple[CublasLt, RecordingLt]:
    blas = CublasLt.__new__(CublasLt)
    lt = RecordingLt(found)
    blas._cublas = SimpleNamespace(ComputeType=SimpleNamespace(COMPUTE_32F=68))
    blas._lt, blas.handle, blas.workspace_ptr, blas.workspace_bytes = lt, 1, BASE, 1 << 20
    blas.device = SimpleNamespace(stream_handle=lambda stream: 0)
    blas._plans, blas._unsupported = {}, set()
    blas._one, blas._zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    return blas, lt


def key(bias: int = 0, act: str = "none", **kw) -> GemmKey:
    args = dict(m=100, n=96, k=64, dtype="bf16", y_dtype=None, x_ld=None, y_ld=None, w_ld=None, w_layout="nk",
                batch=1, strides=(0, 0, 0), x=BASE, w=BASE + 4096, y=BASE + 8192)
    args.update(kw)
    return CublasLt._key(bias=bias, act=act, **args)


def test_epilogue_names() -> None:
    assert epilogue_name(0, "none") == "none"
    assert epilogue_name(BASE + 256, "none") == "bias"
    assert epilogue_name(0, "gelu_tanh") == "gelu"
    assert epilogue_name(BASE + 16, "gelu_tanh") == "gelu_bias"


@pytest.mark.parametrize("act", ["gelu", "relu", "GELU_TANH", ""])
def test_unknown_act_is_refused(act: str) -> None:
    with pytest.raises(ShapeError, match="act="):
        key(act=act)


@pytest.mark.parametrize("offset", [2, 8, 24])
def test_misaligned_bias_is_refused(offset: int) -> None:
    with pytest.raises(ShapeError, match="16-byte aligned"):
        key(bias=BASE + offset)


def test_epilogue_with_batch_is_refused() -> None:
    with pytest.raises(ShapeError, match="batch > 1"):
        key(bias=BASE + 256, batch=4, strides=(64, 64, 96))
    key(batch=4, strides=(64, 64, 96))  # no epilogue: still fine


def test_key_separates_epilogues_and_ignores_the_bias_address() -> None:
    plain, biased, gelu = key(), key(bias=BASE + 256), key(bias=BASE + 256, act="gelu_tanh")
    assert len({plain, biased, gelu}) == 3
    assert plain.epilogue == "none" and plain == GemmKey(**{**plain.__dict__})
    assert key(bias=BASE + 512) == biased  # the bias pointer is set per call, so one plan serves every bias


def test_plain_plan_sets_no_epilogue_attribute() -> None:
    blas, lt = recording_blas()
    blas.linear(BASE + 8192, BASE, BASE + 4096, 100, 96, 64)
    names = [e[2] for e in lt.log if e[0] == "desc_set"]
    assert names == ["TRANSA", "TRANSB"]
    assert [e for e in lt.log if e[0] == "matmul"][0][2] == 0.0


@pytest.mark.parametrize("act,epi", [("none", _Epi.BIAS), ("gelu_tanh", _Epi.GELU_BIAS)])
def test_epilogue_is_set_before_the_heuristic_and_bias_per_call(act: str, epi: _Epi) -> None:
    blas, lt = recording_blas()
    bias1, bias2 = BASE + (1 << 16), BASE + (2 << 16)
    blas.linear(BASE + 8192, BASE, BASE + 4096, 100, 96, 64, bias=bias1, act=act, accumulate=True)
    heur = next(i for i, e in enumerate(lt.log) if e[0] == "heuristic")
    desc = lt.log[heur][1]
    before = [e for e in lt.log[:heur] if e[0] == "desc_set" and e[1] == desc]
    assert ("desc_set", desc, "EPILOGUE", int(epi)) in before
    blas.linear(BASE + 8192, BASE, BASE + 4096, 100, 96, 64, bias=bias2, act=act, accumulate=True)
    assert sum(e[0] == "heuristic" for e in lt.log) == 1  # second bias: same plan
    pointers = [e[3] for e in lt.log if e[0] == "desc_set" and e[2] == "BIAS_POINTER"]
    matmuls = [i for i, e in enumerate(lt.log) if e[0] == "matmul"]
    assert len(matmuls) == 2 and pointers[-1] == bias2 and bias1 in pointers
    last_bias_set = max(i for i, e in enumerate(lt.log) if e[0] == "desc_set" and e[2] == "BIAS_POINTER")
    assert matmuls[0] < last_bias_set < matmuls[1]  # set again right before the second launch
    assert all(lt.log[i][2] == 1.0 and lt.log[i][3] == lt.log[i][4] == BASE + 8192 for i in matmuls)  # C = D = Y


def test_no_algorithm_for_an_epilogue_raises_before_launch_and_is_remembered() -> None:
    blas, lt = recording_blas(found=0)
    with pytest.raises(EpilogueUnsupported):
        blas.linear(BASE + 8192, BASE, BASE + 4096, 100, 96, 64, dtype="f32", bias=BASE + 256)
    assert not any(e[0] == "matmul" for e in lt.log)
    assert sum(e[0] == "destroy" for e in lt.log) == 4  # three layouts and the descriptor
    with pytest.raises(EpilogueUnsupported):
        blas.linear(BASE + 8192, BASE, BASE + 4096, 100, 96, 64, dtype="f32", bias=BASE + 512)
    assert sum(e[0] == "heuristic" for e in lt.log) == 1  # the second refusal comes from the cache
    with pytest.raises(ShapeError) as info:  # a plain GEMM without algorithm stays a plain ShapeError
        blas.linear(BASE + 8192, BASE, BASE + 4096, 100, 96, 64, dtype="f32")
    assert not isinstance(info.value, EpilogueUnsupported)
