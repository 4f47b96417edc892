// FP8 (e4m3fn) KV cache helpers: the rule of gpu_engine/reference/fp8_kv.py on the GPU.
//
// A cached K or V row of one (token, kv head) is head_dim e4m3 bytes plus one float32 scale s = amax(|row|) / 448
// (1 for an all-zero row); the bytes are e4m3(x / s), round to nearest even, saturating. Stores quantise the value
// the bf16 / f32 cache would have held (x already rounded to the compute dtype), so the bytes equal
// reference/fp8_kv.quantize_kv on that value. Readers: the per-head paged attention widens single bytes;
// flash_prefill dequantises its staged tile into bf16 rows, bf16(e4m3 * s); paged_attention_mma_fp8
// (paged_mma_fp8.cuh) turns e4m3 words into exact bf16 mma operands in registers (e4m3x4_to_bf16x2) and applies
// the scales per key, to the score and to P, never per element.
// No NaN: the store saturates (cvt ... satfinite, scales amax / 448), so 0x7f / 0xff are never written, and the
// readers do not test for them (e4m3x4_to_bf16x2 would read 0x7f as 480).
// sm_90 PTX (cvt ... e4m3x2 is sm_89+, mul.bf16x2 sm_90). Include after common.cuh.
#pragma once

#define E4M3_MAX 448.0f

// x -> e4m3 bits (round to nearest even, saturating at +-448); x / s is an IEEE division, as numpy's
__device__ __forceinline__ unsigned char e4m3_from_f(float x) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
    return (unsigned char)(r & 0xffu);
}

// two e4m3 bytes (lo in bits 0-7) -> two floats, exact (every e4m3 value is an f16)
__device__ __forceinline__ void e4m3x2_to_f(unsigned short v, float& lo, float& hi) {
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }"
        : "=f"(lo), "=f"(hi) : "r"(h2));
}

__device__ __forceinline__ float e4m3_to_f(unsigned char v) {
    float lo, hi;
    e4m3x2_to_f((unsigned short)v, lo, hi);
    return lo;
}

// the scale of a row whose largest magnitude is amax
__device__ __forceinline__ float kv_scale_of(float amax) { return amax > 0.0f ? amax / E4M3_MAX : 1.0f; }

// 4-byte async copy global -> shared (the scales); src_bytes = 0 writes zeros
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// four e4m3 bytes of a word -> two packed bf16 pairs of bf16(e4m3 * s)
__device__ __forceinline__ void dequant_word(unsigned w, float s, unsigned& p01, unsigned& p23) {
    float a, b, c, d;
    e4m3x2_to_f((unsigned short)(w & 0xffffu), a, b);
    e4m3x2_to_f((unsigned short)(w >> 16), c, d);
    p01 = pack_bf16(a * s, b * s);
    p23 = pack_bf16(c * s, d * s);
}

// Shared-memory tile dequantisation: rows [ROWS] of HD e4m3 bytes (row stride LDB bytes) with one float scale each
// -> bf16 rows (row stride LD elements). Each thread takes 16-byte chunks in turn; needs 16-byte aligned rows.
template <int HD, int ROWS, int LDB, int LD, int THREADS>
__device__ __forceinline__ void dequant_tile(bf16_t* dst, const unsigned char* raw, const float* scales) {
    constexpr int CH = HD / 16;
#pragma unroll 4
    for (int i = threadIdx.x; i < ROWS * CH; i += THREADS) {
        const int r = i / CH, c = i % CH;
        const uint4 u = *reinterpret_cast<const uint4*>(raw + r * LDB + c * 16);
        const float s = scales[r];
        uint4 lo, hi;
        dequant_word(u.x, s, lo.x, lo.y);
        dequant_word(u.y, s, lo.z, lo.w);
        dequant_word(u.z, s, hi.x, hi.y);
        dequant_word(u.w, s, hi.z, hi.w);
        uint4* out = reinterpret_cast<uint4*>(dst + r * LD + c * 16);
        out[0] = lo;
        out[1] = hi;
    }
}

// e4m3 bits placed in a bf16 (sign to bit 15, exponent and mantissa to bits 10..4) read as e4m3 x 2^-120 exactly,
// subnormals included (both formats' subnormals line up); one bf16 multiply by 2^120 makes it the e4m3 value
// itself, exact (3 mantissa bits, result normal or zero; bf16 arithmetic keeps subnormal inputs, unlike an mma
// operand of 2^-120 x e4m3 whose products would sink below the fp32 normal range).
#define BF16X2_2P120 0x7B807B80u  // bf16 2^120 in both halves
__device__ __forceinline__ unsigned e4m3_pair_bits(unsigned w) {  // bytes 1 and 3 of w (at bits 15..8, 31..24)
    return (w & 0x80008000u) | ((w & 0x7F007F00u) >> 4);
}
__device__ __forceinline__ unsigned bf16x2_mul(unsigned a, unsigned b) {
    unsigned r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// four e4m3 bytes b0..b3 of a word -> exact bf16 pairs even = (b0, b2) and odd = (b1, b3) (lo half first). The
// pairing is the cheap one (no byte permute); the mma kernel lays its fragments out to match it.
__device__ __forceinline__ void e4m3x4_to_bf16x2(unsigned w, unsigned& even, unsigned& odd) {
    even = bf16x2_mul(e4m3_pair_bits(w << 8), BF16X2_2P120);
    odd = bf16x2_mul(e4m3_pair_bits(w), BF16X2_2P120);
}

// byte permute: result byte i = byte sel_i of the 8 bytes {b (4..7), a (0..3)}
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
