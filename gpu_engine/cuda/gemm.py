"""GEMMs through cuBLASLt (nvmath-python's low-level bindings) on raw device addresses.

One call shape covers every projection of the model: Y[m, n] = X[m, k] @ W[n, k]^T (+ beta * Y), with W stored
row-major like a torch Linear weight (w_layout="nk"); w_layout="kn" takes W stored as [k, n] (Y = X @ W, e.g.
probabilities times the value rows of an attention head). Operands may be column slices of wider buffers (row
strides x_ld / w_ld / y_ld); cuBLASLt is told the real alignment of the addresses, since it assumes 256 bytes.
batch > 1 runs that many products in one call, operand i at its base + i * its batch stride (e.g. the heads of an
attention layer). cuBLASLt is column-major, so this is the "TN" product D = op(A) B with
A = W (transposed), B = X: the layout Hopper's FP8 kernels also require.

Block-scaled FP8 (`linear_fp8`, issue 15): X and W in e4m3, W with one float32 scale per 128x128 block
(cuBLASLt's BLK128x128_32F scale mode on A) and X with one per token per 128 input features (VEC128_32F on B),
Y in bf16; cuBLAS >= 12.9 on sm_90. The scale tensors' layouts are fp8_ops.py's (weight_scale_layout /
act_scale_layout); only the scale pointers change between calls of one plan.

Optional epilogue (bias=..., act=...): Y = act(X @ W^T (+ Y) + bias) with bias[n] per output feature, in Y's
dtype, fused into the GEMM's store (cuBLASLt EPILOGUE_BIAS / GELU_BIAS / GELU; in cuBLASLt's column-major view D
is [n, m], and its bias runs along D's rows, i.e. one value per output feature). With accumulate=True the bias
is added after the residual: Y = Y + X @ W^T + bias. act="gelu_tanh" is cuBLASLt's GELU epilogue, which we take
to be the tanh form (tests/cuda_runner/check_kernels.py measures it against both GELU forms; see the report of the
commit that added it). An epilogue cuBLASLt has no algorithm for raises EpilogueUnsupported before anything is
launched, so callers can fall back to separate kernels.

Plans (descriptors + the heuristic's algorithm) are cached per shape, dtype and epilogue; the decode step reuses a
handful.
No torch or cupy here: addresses are plain ints from our arena.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .device import CudaDevice
from .errors import CudaUnavailable, ShapeError

# cudaDataType_t values (library_types.h); stable ABI numbers.
CUDA_DTYPES = {"f32": 0, "bf16": 14, "e4m3": 28}
ITEMSIZE = {"f32": 4, "bf16": 2, "e4m3": 1}
SCALED_DTYPES = ("e4m3",)  # operand dtypes that only come block-scaled (linear_fp8)
TUNE_MAX_M = 64  # shapes with at most this many rows get their algorithm chosen by timing
TUNE_CANDIDATES = 16
# ...unless the weight is this big: timing 16 candidates of the 9B LM head (2 GB) costs ~0.1 s of a run per new row
# count, where its heuristic choice loses at most a fraction of its ~0.5 ms (the 9B document run spent 2.2 s of
# 29 s in candidate timing, session 8's host profile).
TUNE_MAX_WEIGHT_BYTES = 512 << 20
TUNE_REPS = 3  # timed calls a candidate, after one warm-up call (events: enough to rank weight-streaming GEMMs)
GEMM_ACTS = ("none", "gelu_tanh")
BIAS_ALIGN = 16  # bytes; our arena hands out 256-aligned vectors, cuBLASLt's vectorised bias loads need <= 16
# (bias given, act) -> our epilogue name; cuBLASLt's Epilogue enum member of each
EPILOGUES = {(False, "none"): "none", (True, "none"): "bias", (False, "gelu_tanh"): "gelu",
             (True, "gelu_tanh"): "gelu_bias"}
_LT_EPILOGUE = {"bias": "BIAS", "gelu": "GELU", "gelu_bias": "GELU_BIAS"}


def tune_candidates(m: int, n: int, k: int, itemsize: int, tune: bool) -> int:
    """How many heuristic candidates a new plan times (1: take the heuristic's first)."""
    return TUNE_CANDIDATES if tune and m <= TUNE_MAX_M and n * k * itemsize < TUNE_MAX_WEIGHT_BYTES else 1


class EpilogueUnsupported(ShapeError):
    """cuBLASLt found no algorithm for this GEMM with the requested epilogue (nothing was launched)."""


def epilogue_name(bias: int, act: str) -> str:
    """Our epilogue name for a (bias address or 0, act) request; refuses unknown acts and misaligned biases."""
    if act not in GEMM_ACTS:
        raise ShapeError(f"act={act!r} not supported by the GEMM epilogue (have {GEMM_ACTS})")
    if bias < 0 or bias % BIAS_ALIGN:
        raise ShapeError(f"bias address {bias:#x} must be {BIAS_ALIGN}-byte aligned")
    return EPILOGUES[(bias != 0, act)]


def _lt() -> tuple[Any, Any]:
    try:
        from nvmath.bindings import cublas, cublasLt
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise CudaUnavailable(f"nvmath-python is not installed ({exc}); pip install 'docpipe[cuda]'") from exc
    return cublas, cublasLt


@dataclass(frozen=True)
class GemmKey:
    m: int
    n: int
    k: int
    x_dtype: str
    w_dtype: str
    y_dtype: str
    x_ld: int
    y_ld: int
    w_ld: int = 0  # 0: packed (k for "nk", n for "kn")
    w_layout: str = "nk"
    align: int = 256  # bytes: the largest power of two (<= 256) dividing every operand address (and batch stride)
    batch: int = 1
    x_stride: int = 0  # batch strides in elements
    w_stride: int = 0
    y_stride: int = 0
    epilogue: str = "none"  # a value of EPILOGUES: part of the key (the heuristic's algorithms differ per epilogue)
    block_scaled: bool = False  # FP8: W by 128x128 blocks, X by 1x128 groups (linear_fp8)


@dataclass
class _Plan:
    desc: int
    a_layout: int
    b_layout: int
    d_layout: int
    heuristics: Any  # MatmulHeuristicResult array (kept alive: cuBLASLt reads the algorithm struct in place)
    algo_ptr: int  # address of the chosen candidate's algorithm (first field of its heuristic result)
    candidates: int
    timings_ms: list[float]
    epilogue: str = "none"
    block_scaled: bool = False


class CublasLt:
    """cuBLASLt handle + workspace + plan cache for one device."""

    def __init__(self, device: CudaDevice, workspace_ptr: int, workspace_bytes: int) -> None:
        self._cublas, self._lt = _lt()
        self.device = device
        self.handle = self._lt.create()
        self.workspace_ptr = workspace_ptr
        self.workspace_bytes = workspace_bytes
        self._plans: dict[GemmKey, _Plan] = {}
        self._unsupported: set[GemmKey] = set()  # epilogue keys the heuristic had no algorithm for
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)

    @property
    def version(self) -> int:
        return int(self._lt.get_version())

    def linear(self, y: int, x: int, w: int, m: int, n: int, k: int, *, dtype: str = "bf16",
               y_dtype: str | None = None, x_ld: int | None = None, y_ld: int | None = None,
               w_ld: int | None = None, w_layout: str = "nk", accumulate: bool = False, stream: Any = None,
               batch: int = 1, strides: tuple[int, int, int] = (0, 0, 0), bias: int = 0,
               act: str = "none") -> None:
        """Y[m, n] (+)= X[m, k] @ W[n, k]^T ("nk") or X[m, k] @ W[k, n] ("kn"). X and W in `dtype`; Y in `y_dtype`
        (default `dtype`); fp32 accumulate.

        x_ld / y_ld / w_ld: row strides in elements (default packed) so that an operand can be a slice of a wider
        buffer. accumulate=True adds into Y (beta = 1), e.g. a residual stream. batch / strides: `batch` products,
        the i-th reading X, W and writing Y at i * (x, w, y) stride elements from the given addresses.
        bias: address of a [n] vector in `y_dtype` (0: none), added per output feature in the epilogue;
        act: "gelu_tanh" applies GELU after the bias (and after the accumulation). Not with batch > 1.
        """
        key = self._key(m, n, k, dtype, y_dtype, x_ld, y_ld, w_ld, w_layout, batch, strides, x, w, y, bias, act)
        if key in self._unsupported:
            raise EpilogueUnsupported(f"cuBLASLt has no algorithm for {key}")
        plan = self._plans.get(key) or self._make_plan(key, y, x, w, bias, tune=not accumulate)
        self._matmul(plan, plan.algo_ptr, y, x, w, accumulate, stream, bias)

    def linear_fp8(self, y: int, x: int, x_scales: int, w: int, w_scales: int, m: int, n: int, k: int, *,
                   x_ld: int | None = None, y_ld: int | None = None, w_ld: int | None = None,
                   stream: Any = None) -> None:
        """Y[m, n] (bf16) = dequant(X)[m, k] @ dequant(W)[n, k]^T with X, W e4m3 (byte row strides x_ld / w_ld,
        default k), `w_scales` the weight's 128x128 block scales and `x_scales` X's per-token 128-group scales, both
        float32 in fp8_ops' layouts. No epilogue, no accumulation. Raises ShapeError when cuBLASLt (older than
        12.9, or not Hopper) has no block-scaled algorithm."""
        if min(x_scales, w_scales) <= 0 or (x_scales | w_scales) % 16:
            raise ShapeError(f"FP8 scale tensors need 16-byte aligned addresses, got {x_scales:#x} / {w_scales:#x}")
        if k % 16:
            raise ShapeError(f"FP8 GEMMs need k a multiple of 16 (16-byte rows), got k={k}")
        key = self._key(m, n, k, "e4m3", "bf16", x_ld, y_ld, w_ld, "nk", 1, (0, 0, 0), x, w, y, 0, "none",
                        scaled=True)
        try:
            plan = self._plans.get(key) or self._make_plan(key, y, x, w, 0, tune=True, scales=(w_scales, x_scales))
            self._matmul(plan, plan.algo_ptr, y, x, w, False, stream, 0, (w_scales, x_scales))
        except self._lt.cuBLASLtError as exc:  # e.g. an algorithm the heuristic offered that refuses the shape
            self._plans.pop(key, None)
            raise ShapeError(f"cuBLASLt block-scaled FP8 matmul failed for {key}: {exc}") from exc

    @staticmethod
    def _key(m: int, n: int, k: int, dtype: str, y_dtype: str | None, x_ld: int | None, y_ld: int | None,
             w_ld: int | None, w_layout: str, batch: int, strides: tuple[int, int, int], x: int, w: int, y: int,
             bias: int, act: str, scaled: bool = False) -> GemmKey:
        """Validate one linear() / linear_fp8() request and return its plan key (pure: no cuBLASLt call)."""
        y_dtype = y_dtype or dtype
        for name, dt in (("dtype", dtype), ("y_dtype", y_dtype)):
            if dt not in CUDA_DTYPES or (name == "y_dtype" and dt in SCALED_DTYPES):
                raise ShapeError(f"{name}={dt!r} not supported (have {sorted(CUDA_DTYPES)})")
        if (dtype in SCALED_DTYPES) != scaled:
            raise ShapeError(f"dtype={dtype!r}: e4m3 operands go through linear_fp8 (block-scaled), other dtypes "
                             "through linear")
        if min(m, n, k) <= 0:
            raise ShapeError(f"GEMM sizes must be positive, got m={m} n={n} k={k}")
        if w_layout not in ("nk", "kn"):
            raise ShapeError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
        packed_w = k if w_layout == "nk" else n
        if batch < 1 or (batch > 1 and min(strides) < 1):
            raise ShapeError(f"batch {batch} needs positive batch strides, got {strides}")
        in_size, out_size = ITEMSIZE[dtype], ITEMSIZE[y_dtype]
        align = 256
        offsets = (x, w, y) + ((strides[0] * in_size, strides[1] * in_size, strides[2] * out_size) if batch > 1 else ())
        for value in offsets:
            if value:
                align = min(align, value & -value)  # lowest set bit of the address / stride in bytes
        epilogue = epilogue_name(bias, act)
        if epilogue != "none" and batch > 1:
            raise ShapeError("a GEMM epilogue (bias / act) is not supported with batch > 1")
        key = GemmKey(m, n, k, dtype, dtype, y_dtype, x_ld or k, y_ld or n, w_ld or packed_w, w_layout, align,
                      batch, *(strides if batch > 1 else (0, 0, 0)), epilogue=epilogue, block_scaled=scaled)
        if key.x_ld < k or key.y_ld < n or key.w_ld < packed_w:
            raise ShapeError(f"row strides too small: x_ld={key.x_ld} (k={k}), y_ld={key.y_ld} (n={n}), "
                             f"w_ld={key.w_ld} ({packed_w})")
        return key

    def _matmul(self, plan: _Plan, algo_ptr: int, y: int, x: int, w: int, accumulate: bool, stream: Any,
                bias: int = 0, scales: tuple[int, int] = (0, 0)) -> None:
        beta = self._one if accumulate else self._zero
        if plan.block_scaled:  # (A = W, B = X) scale pointers; the descriptor is shared by every layer of the shape
            self._set_scales(plan.desc, scales)
        if plan.epilogue in ("bias", "gelu_bias"):  # the plan's descriptor is shared by every bias of this shape
            lt = self._lt
            self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, plan.desc,
                      lt.MatmulDescAttribute.BIAS_POINTER, bias)
        self._lt.matmul(
            self.handle, plan.desc, self._one.ctypes.data, w, plan.a_layout, x, plan.b_layout,
            beta.ctypes.data, y, plan.d_layout, y, plan.d_layout, algo_ptr,
            self.workspace_ptr, self.workspace_bytes, self.device.stream_handle(stream),
        )

    def _set(self, setter: Any, dtype_of: Any, obj: int, attr: Any, value: int) -> None:
        buf = np.array([value], dtype=dtype_of(attr))
        setter(obj, attr, buf.ctypes.data, buf.nbytes)

    def _set_scales(self, desc: int, scales: tuple[int, int]) -> None:
        lt = self._lt
        mda = lt.MatmulDescAttribute
        for attr, ptr in ((mda.A_SCALE_POINTER, scales[0]), (mda.B_SCALE_POINTER, scales[1])):
            self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc, attr, ptr)

    def _make_plan(self, key: GemmKey, y: int, x: int, w: int, bias: int, tune: bool,
                   scales: tuple[int, int] = (0, 0)) -> _Plan:
        """Descriptors + algorithm for one shape. Small-m (decode) shapes are weight-streaming, where the
        heuristic's first choice is often not the fastest: time its top candidates once, on the real operands
        (beta = 0, so Y is only overwritten; never when the caller accumulates into Y), and keep the fastest.
        Not callable during graph capture."""
        lt, cublas = self._lt, self._cublas
        scale_type = CUDA_DTYPES["f32"]
        desc = lt.matmul_desc_create(cublas.ComputeType.COMPUTE_32F, scale_type)
        mda = lt.MatmulDescAttribute
        trans_a = 1 if key.w_layout == "nk" else 0  # OP_T / OP_N
        self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc, mda.TRANSA, trans_a)
        self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc, mda.TRANSB, 0)  # OP_N
        if key.epilogue != "none":  # set before the heuristic query: the algorithm list depends on it. The bias
            # type is left at its default, D's type (= y_dtype); its pointer is set per call in _matmul.
            self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc, mda.EPILOGUE,
                      int(getattr(lt.Epilogue, _LT_EPILOGUE[key.epilogue])))
            if bias:
                self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc,
                          mda.BIAS_POINTER, bias)
        if key.block_scaled:  # before the heuristic query: only block-scaled FP8 kernels can take these modes
            modes = ((mda.A_SCALE_MODE, lt.MatmulMatrixScale.BLK128x128_32F),
                     (mda.B_SCALE_MODE, lt.MatmulMatrixScale.VEC128_32F))
            for attr, mode in modes:
                self._set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc, attr, int(mode))
            self._set_scales(desc, scales)
        # column-major views: A = W^T storage [k, n] ld w_ld ("nk": op T) or W^T = [n, k] ld w_ld ("kn": op N);
        # B = X^T storage [k, m] ld x_ld; D = Y^T [n, m] ld y_ld
        a_rows, a_cols = (key.k, key.n) if key.w_layout == "nk" else (key.n, key.k)
        a_layout = lt.matrix_layout_create(CUDA_DTYPES[key.w_dtype], a_rows, a_cols, key.w_ld)
        b_layout = lt.matrix_layout_create(CUDA_DTYPES[key.x_dtype], key.k, key.m, key.x_ld)
        d_layout = lt.matrix_layout_create(CUDA_DTYPES[key.y_dtype], key.n, key.m, key.y_ld)
        if key.batch > 1:  # MatrixLayoutAttribute BATCH_COUNT = 5, STRIDED_BATCH_OFFSET = 6
            for layout, stride in ((a_layout, key.w_stride), (b_layout, key.x_stride), (d_layout, key.y_stride)):
                self._set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype, layout,
                          lt.MatrixLayoutAttribute(5), key.batch)
                self._set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype, layout,
                          lt.MatrixLayoutAttribute(6), stride)
        pref = lt.matmul_preference_create()
        self._set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype, pref,
                  lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, self.workspace_bytes)
        if key.align < 256:  # MIN_ALIGNMENT_{A,B,C,D}_BYTES (enum values 5..8): cuBLASLt's default promise is 256
            for value in (5, 6, 7, 8):
                self._set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype, pref,
                          lt.MatmulPreferenceAttribute(value), key.align)
        wanted = tune_candidates(key.m, key.n, key.k, ITEMSIZE[key.w_dtype], tune)
        heuristics = lt.MatmulHeuristicResult(wanted)
        count = np.zeros(1, np.int32)
        why = ""
        try:
            lt.matmul_algo_get_heuristic(self.handle, desc, a_layout, b_layout, d_layout, d_layout, pref, wanted,
                                         heuristics.ptr, count.ctypes.data)
        except lt.cuBLASLtError as exc:  # NOT_SUPPORTED: e.g. block-scaled FP8 on a cuBLAS older than 12.9
            if not key.block_scaled:
                raise
            count[0], why = 0, f" ({exc}; cuBLASLt version {self.version})"
        lt.matmul_preference_destroy(pref)
        found = int(count[0])
        if found < 1:
            for layout in (a_layout, b_layout, d_layout):
                lt.matrix_layout_destroy(layout)
            lt.matmul_desc_destroy(desc)
            if key.epilogue != "none":
                self._unsupported.add(key)
                raise EpilogueUnsupported(f"cuBLASLt has no algorithm for {key}")
            raise ShapeError(f"cuBLASLt has no algorithm for {key}{why}")
        stride = lt.matmul_heuristic_result_dtype.itemsize
        plan = _Plan(desc, a_layout, b_layout, d_layout, heuristics, heuristics.ptr, found, [], key.epilogue,
                     key.block_scaled)
        if found > 1:
            plan.timings_ms = [self._time(plan, heuristics.ptr + i * stride, y, x, w, bias, scales=scales)
                               for i in range(found)]
            plan.algo_ptr = heuristics.ptr + int(np.argmin(plan.timings_ms)) * stride
        self._plans[key] = plan
        return plan

    def _time(self, plan: _Plan, algo_ptr: int, y: int, x: int, w: int, bias: int = 0, reps: int = TUNE_REPS,
              scales: tuple[int, int] = (0, 0)) -> float:
        dev = self.device
        self._matmul(plan, algo_ptr, y, x, w, False, None, bias, scales)
        start, stop = dev.event(), dev.event()
        dev.stream.record(start)
        for _ in range(reps):
            self._matmul(plan, algo_ptr, y, x, w, False, None, bias, scales)
        dev.stream.record(stop)
        stop.sync()
        return float(stop - start) / reps

    def close(self) -> None:
        lt = self._lt
        for plan in self._plans.values():
            lt.matrix_layout_destroy(plan.a_layout)
            lt.matrix_layout_destroy(plan.b_layout)
            lt.matrix_layout_destroy(plan.d_layout)
            lt.matmul_desc_destroy(plan.desc)
        self._plans.clear()
        lt.destroy(self.handle)
