// FP8 on the wire (ulysses_kernels/wire.py): the quantization of one (token, head) row and
// its dequantization, shared by the CUDA kernels (fp8.cu) and their CPU twin (fp8_cpu.cpp).
// Torch-free: raw byte pointers, byte strides.
//
// One wire row of a head of D elements is D + 4 bytes:
//
//     | q[0] q[1] ... q[D-1] | scale (float32, little-endian) |
//
// quantize: amax = max(max |x_i|, 2^-100); inv = MAX / amax; q_i = fp8(clamp(x_i * inv));
//           scale = amax / MAX (IEEE divisions, round to nearest even everywhere)
// dequantize: x'_i = dtype(float(q_i) * scale); replicas summed in rank order in dtype.
// The encodings are integer operations on float32 bits, as in kernels/triton_fp8.py, so the
// host and the device run the very same code (NaN inputs: unspecified bits).
#pragma once

#include "layout_math.h"

namespace ulysses_kernels {

struct Fp8Format {
  int mb, bias, sub_exp;  // mantissa bits, exponent bias, exponent of the smallest subnormal
  float max, min_normal, sub_step;
  bool e4m3;
};

// fmt 0: e4m3 (float8_e4m3fn, max 448); 1: e5m2 (float8_e5m2, max 57344).
UK_HD Fp8Format fp8_format(int fmt) {
  return fmt == 0 ? Fp8Format{3, 7, -9, 448.0f, 0.015625f, 0.001953125f, true}
                  : Fp8Format{2, 15, -16, 57344.0f, 6.103515625e-05f, 1.52587890625e-05f, false};
}

// The element types of the attention tensors: 0 float32, 1 float16, 2 bfloat16.
enum Fp8Dtype { kFp8F32 = 0, kFp8F16 = 1, kFp8BF16 = 2 };

UK_HD float load_as_float(const char* p, int dt) {
  if (dt == kFp8F32) {
    float f;
    memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, p, 2);
  return dt == kFp8BF16 ? bf16_to_float(h) : half_to_float(h);
}

// float32 -> the dtype, round to nearest even, as float32 (exact).
UK_HD float round_to_dtype(float v, int dt) {
  if (dt == kFp8F32) return v;
  return dt == kFp8BF16 ? bf16_to_float(float_to_bf16(v)) : half_to_float(float_to_half(v));
}

UK_HD void store_dtype(char* p, float v, int dt) {  // v already a value of the dtype
  if (dt == kFp8F32) {
    memcpy(p, &v, 4);
    return;
  }
  const uint16_t h = dt == kFp8BF16 ? float_to_bf16(v) : float_to_half(v);
  memcpy(p, &h, 2);
}

// a * b rounded once: nvcc contracts a product and a following add into one FMA (--fmad=true
// is its default), which the reference, rounding the product first, does not.
UK_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// a / b correctly rounded whatever the compiler's flags (-prec-div=false, --use_fast_math).
UK_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// float32 y (finite, |y| <= the format's max) -> FP8 bits, round to nearest even.
UK_HD uint8_t fp8_encode(float y, const Fp8Format& f) {
  const uint32_t u = float_bits(y), sign = (u >> 31) << 7, a = u & 0x7fffffffu;
  if (bits_float(a) < f.min_normal) {
    // The 24-bit significand in units of the smallest subnormal (k >= 21 here).
    int k = 150 + f.sub_exp - (int)(a >> 23);
    k = k > 31 ? 31 : k;
    const uint32_t sig = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = sig >> k;
    const uint32_t rem = sig & ((1u << k) - 1u), half = 1u << (k - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return (uint8_t)(q | sign);
  }
  const int drop = 23 - f.mb;
  const uint32_t r = a + ((1u << (drop - 1)) - 1u) + ((a >> drop) & 1u);
  return (uint8_t)(((r >> drop) - ((uint32_t)(127 - f.bias) << f.mb)) | sign);
}

// FP8 bits -> float32 (exact).
UK_HD float fp8_decode(uint8_t b, const Fp8Format& f) {
  const uint32_t emask = (1u << (7 - f.mb)) - 1u;
  const uint32_t e = ((uint32_t)b >> f.mb) & emask, m = b & ((1u << f.mb) - 1u), sign = ((uint32_t)b >> 7) << 31;
  if (f.e4m3 ? (b & 0x7f) == 0x7f : (e == emask && m != 0)) return bits_float(0x7fc00000u);
  if (!f.e4m3 && e == emask) return bits_float(sign | 0x7f800000u);
  if (e == 0) return bits_float(float_bits(mul_rn((float)m, f.sub_step)) | sign);
  return bits_float(sign | ((e + (uint32_t)(127 - f.bias)) << 23) | (m << (23 - f.mb)));
}

constexpr uint32_t kAmaxFloorBits = 0x0d800000u;  // 2^-100 (wire.AMAX_FLOOR)

// One row: D elements of dtype `dt` at `src` (stride `sd` bytes) -> D + 4 bytes at `dst`.
UK_HD void quantize_row(const char* src, int64_t sd, int dt, int64_t D, char* dst, const Fp8Format& f) {
  float amax = bits_float(kAmaxFloorBits);
  for (int64_t d = 0; d < D; ++d) {
    const float x = load_as_float(src + d * sd, dt);
    const float ax = x < 0 ? -x : x;
    amax = ax > amax ? ax : amax;
  }
  const float inv = div_rn(f.max, amax), scale = div_rn(amax, f.max);
  for (int64_t d = 0; d < D; ++d) {
    float y = mul_rn(load_as_float(src + d * sd, dt), inv);
    y = y > f.max ? f.max : (y < -f.max ? -f.max : y);
    dst[d] = (char)fp8_encode(y, f);
  }
  memcpy(dst + D, &scale, 4);
}

// Element d of a wire row, dequantized and rounded to the dtype (as float32).
UK_HD float dequantize_elem(const char* row, int64_t D, int64_t d, int dt, const Fp8Format& f) {
  float scale;
  memcpy(&scale, row + D, 4);
  return round_to_dtype(mul_rn(fp8_decode((uint8_t)row[d], f), scale), dt);
}

// Output row r of a dequantizing unpack (UnpackParams over wire blocks: byte strides, the
// blocks' D stride one byte; elem/od: the output's): the first holder of r.head written,
// each later one added in the dtype (round after every add, as add_). False: no holder.
UK_HD bool dequantize_out_row(const UnpackParams& p, const OutRow& r, int dt, const Fp8Format& f) {
  char* out = p.out + r.b * p.ob + r.t * p.os + r.head * p.oh;
  bool any = false;
  for (int s = 0; s < p.n_src; ++s) {
    if (!holds(p, s, r.head)) continue;
    const Strided4& k = p.blk[s];
    const char* row = k.ptr + r.b * k.sb + r.t * k.ss + (r.head - (int64_t)p.head0[s]) * k.sh;
    for (int64_t d = 0; d < p.d; ++d) {
      float v = dequantize_elem(row, p.d, d, dt, f);
      if (any) v = round_to_dtype(load_as_float(out + d * p.od, dt) + v, dt);
      store_dtype(out + d * p.od, v, dt);
    }
    any = true;
  }
  return any;
}

}  // namespace ulysses_kernels
