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

// ---- rows split over the 32 lanes of a warp ------------------------------------------------
// fp8.cu runs one row per warp; the CPU twin (fp8_cpu.cpp) runs the same functions for lanes
// 0..31 in turn, so both run the same lane split, vector test and byte packing. A lane owns
// the elements {4 * lane + 128 * j .. + 3} on the vector path (contiguous row, D % 4 == 0,
// the pointers aligned for one 4-element load/store), else {lane + 32 * j}. Each element's
// arithmetic is the reference's, and a lane handles its own elements only, in source order,
// so the split changes no bit.

// amax with |x| folded in (the quantization's row maximum).
UK_HD float fold_abs_max(float amax, float x) {
  const float ax = x < 0 ? -x : x;
  return ax > amax ? ax : amax;
}

// One wire byte, dequantized with its row's scale and rounded to the dtype (as float32).
UK_HD float dequantize_byte(uint8_t q, float scale, int dt, const Fp8Format& f) { return round_to_dtype(mul_rn(fp8_decode(q, f), scale), dt); }

// One element: float32 x of the dtype -> FP8 bits of clamp(x * inv).
UK_HD uint8_t quantize_elem(float x, float inv, const Fp8Format& f) {
  float y = mul_rn(x, inv);
  y = y > f.max ? f.max : (y < -f.max ? -f.max : y);
  return fp8_encode(y, f);
}

UK_HD int dtype_bytes(int dt) { return dt == kFp8F32 ? 4 : 2; }

// 4 elements moved as one aligned load/store (device: one vector instruction; host: memcpy).
struct alignas(16) F32x4 {
  float v[4];
};
struct alignas(8) U16x4 {
  uint16_t v[4];
};
struct alignas(4) U8x4 {
  uint8_t v[4];
};

template <class T>
UK_HD T load_vec(const char* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const T*>(p);
#else
  T t;
  memcpy(&t, p, sizeof(T));
  return t;
#endif
}

template <class T>
UK_HD void store_vec(char* p, const T& t) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<T*>(p) = t;
#else
  memcpy(p, &t, sizeof(T));
#endif
}

// 4 consecutive elements of the dtype at `p` (aligned to 4 elements) as float32.
UK_HD void load4(const char* p, int dt, float x[4]) {
  if (dt == kFp8F32) {
    const F32x4 v = load_vec<F32x4>(p);
    for (int i = 0; i < 4; ++i) x[i] = v.v[i];
    return;
  }
  const U16x4 h = load_vec<U16x4>(p);
  for (int i = 0; i < 4; ++i) x[i] = dt == kFp8BF16 ? bf16_to_float(h.v[i]) : half_to_float(h.v[i]);
}

// 4 values of the dtype (already rounded to it) to `p` (aligned to 4 elements).
UK_HD void store4(char* p, const float x[4], int dt) {
  if (dt == kFp8F32) {
    F32x4 v;
    for (int i = 0; i < 4; ++i) v.v[i] = x[i];
    store_vec(p, v);
    return;
  }
  U16x4 h;
  for (int i = 0; i < 4; ++i) h.v[i] = dt == kFp8BF16 ? float_to_bf16(x[i]) : float_to_half(x[i]);
  store_vec(p, h);
}

UK_HD bool aligned(const void* p, uintptr_t bytes) { return ((uintptr_t)p & (bytes - 1)) == 0; }

// The vector path of a quantized row: D elements of dt at src (stride sd bytes) <-> D + 4 wire bytes at wire.
UK_HD bool fp8_row_vector(const char* src, int64_t sd, int dt, int64_t D, const char* wire) {
  const int es = dtype_bytes(dt);
  return sd == es && D % 4 == 0 && aligned(src, 4 * (uintptr_t)es) && aligned(wire, 4);
}

// Quantizing a row, step 1: the largest |x| among this lane's elements (at least 2^-100).
UK_HD float quantize_row_lane_amax(const char* src, int64_t sd, int dt, int64_t D, bool vec, int lane) {
  float amax = bits_float(kAmaxFloorBits);
  if (vec) {
    for (int64_t d = 4 * lane; d < D; d += 4 * kWarp) {
      float x[4];
      load4(src + d * sd, dt, x);
      for (int i = 0; i < 4; ++i) amax = fold_abs_max(amax, x[i]);
    }
    return amax;
  }
  for (int64_t d = lane; d < D; d += kWarp) {
    amax = fold_abs_max(amax, load_as_float(src + d * sd, dt));
  }
  return amax;
}

// Step 2, with the row's amax over all lanes: this lane's FP8 bytes; lane 0 also the scale.
UK_HD void quantize_row_lane_store(const char* src, int64_t sd, int dt, int64_t D, char* dst, float amax, const Fp8Format& f, bool vec,
                                   int lane) {
  const float inv = div_rn(f.max, amax);
  if (vec) {
    for (int64_t d = 4 * lane; d < D; d += 4 * kWarp) {
      float x[4];
      load4(src + d * sd, dt, x);
      U8x4 q;
      for (int i = 0; i < 4; ++i) q.v[i] = quantize_elem(x[i], inv, f);
      store_vec(dst + d, q);
    }
  } else {
    for (int64_t d = lane; d < D; d += kWarp) dst[d] = (char)quantize_elem(load_as_float(src + d * sd, dt), inv, f);
  }
  if (lane == 0) {
    const float scale = div_rn(amax, f.max);
    memcpy(dst + D, &scale, 4);
  }
}

// ---- short rows held in registers, several rows per warp in flight -----------------------
// A vector row of at most 4 * kWarp elements is one load of 4 elements per lane (lanes past D
// idle): its values stay in registers between the amax and the quantization (no second read),
// and a warp issues the loads of kFp8RowsInFlight rows before it reduces any (pack.cu's
// kInFlight, for the FP8 pack). The same elements per lane and the same arithmetic as above.
constexpr int kFp8RowsInFlight = 4;

UK_HD bool fp8_row_in_registers(const RowCopy& r, int dt, int64_t D) {
  return D <= 4 * kWarp && fp8_row_vector(r.src, r.src_unit_stride, dt, D, r.dst);
}

// This lane's 4 elements of a register row into x (zeros past D); returns their largest |x| (at least 2^-100).
UK_HD float quantize_regs_load(const RowCopy& r, int dt, int64_t D, int lane, float x[4]) {
  float amax = bits_float(kAmaxFloorBits);
  const int64_t d = 4 * lane;
  if (d >= D) {
    x[0] = x[1] = x[2] = x[3] = 0.0f;
    return amax;
  }
  load4(r.src + d * r.src_unit_stride, dt, x);
  for (int i = 0; i < 4; ++i) amax = fold_abs_max(amax, x[i]);
  return amax;
}

// With the row's amax over all lanes: this lane's 4 FP8 bytes from x; lane 0 also the scale.
UK_HD void quantize_regs_store(const RowCopy& r, int64_t D, int lane, const float x[4], float amax, const Fp8Format& f) {
  const int64_t d = 4 * lane;
  if (d < D) {
    const float inv = div_rn(f.max, amax);
    U8x4 q;
    for (int i = 0; i < 4; ++i) q.v[i] = quantize_elem(x[i], inv, f);
    store_vec(r.dst + d, q);
  }
  if (lane == 0) {
    const float scale = div_rn(amax, f.max);
    memcpy(r.dst + D, &scale, 4);
  }
}

// Output row r of a dequantizing unpack (UnpackParams over wire blocks: byte strides, the
// blocks' D stride one byte; elem/od: the output's), this lane's elements: the first holder
// of r.head written, each later one added in the dtype (round after every add, as add_).
// False: no holder.
// The sources from `s_begin` on (`any`: an earlier one already wrote the row). Row starts are
// layout_math.h's unpack_dst / unpack_src at unit 0.
UK_HD bool dequantize_out_row_lane_from(const UnpackParams& p, const OutRow& r, int dt, const Fp8Format& f, int lane, int s_begin, bool any) {
  char* out = unpack_dst(p, r, 0, 0);
  const int es = dtype_bytes(dt);
  for (int s = s_begin; s < p.n_src; ++s) {
    if (!holds(p, s, r.head)) continue;
    const char* row = unpack_src(p, r, s, 0, 0);
    float scale;
    memcpy(&scale, row + p.d, 4);
    if (p.od == es && p.d % 4 == 0 && aligned(out, 4 * (uintptr_t)es) && aligned(row, 4)) {
      for (int64_t d = 4 * lane; d < p.d; d += 4 * kWarp) {
        const U8x4 q = load_vec<U8x4>(row + d);
        float v[4], o[4];
        if (any) load4(out + d * es, dt, o);
        for (int i = 0; i < 4; ++i) {
          v[i] = dequantize_byte(q.v[i], scale, dt, f);
          if (any) v[i] = round_to_dtype(o[i] + v[i], dt);
        }
        store4(out + d * es, v, dt);
      }
    } else {
      for (int64_t d = lane; d < p.d; d += kWarp) {
        float v = dequantize_byte((uint8_t)row[d], scale, dt, f);
        if (any) v = round_to_dtype(load_as_float(out + d * p.od, dt) + v, dt);
        store_dtype(out + d * p.od, v, dt);
      }
    }
    any = true;
  }
  return any;
}

UK_HD bool dequantize_out_row_lane(const UnpackParams& p, const OutRow& r, int dt, const Fp8Format& f, int lane) {
  return dequantize_out_row_lane_from(p, r, dt, f, lane, 0, false);
}

// ---- register rows of the dequantizing unpack (fp8.cu takes kFp8RowsInFlight at a time) ----
// A row whose first holder is a vector row of at most 4 * kWarp elements: each lane loads its
// 4 FP8 bytes and the scale of that holder first (every row of the group before any store),
// then decodes and writes them; later holders (replicated KV heads) are added as above.

UK_HD int first_holder(const UnpackParams& p, int64_t head) {
  for (int s = 0; s < p.n_src; ++s) {
    if (holds(p, s, head)) return s;
  }
  return -1;
}

UK_HD bool dequant_row_in_registers(const UnpackParams& p, const OutRow& r, int dt, int s0) {
  const int es = dtype_bytes(dt);
  return s0 >= 0 && p.od == es && p.d % 4 == 0 && p.d <= 4 * kWarp && aligned(unpack_dst(p, r, 0, 0), 4 * (uintptr_t)es) &&
         aligned(unpack_src(p, r, s0, 0, 0), 4);
}

UK_HD void dequant_regs_load(const UnpackParams& p, const OutRow& r, int s0, int lane, U8x4& q, float& scale) {
  const char* row = unpack_src(p, r, s0, 0, 0);
  if (4 * lane < p.d) q = load_vec<U8x4>(row + 4 * lane);
  memcpy(&scale, row + p.d, 4);
}

UK_HD void dequant_regs_store(const UnpackParams& p, const OutRow& r, int s0, int dt, const Fp8Format& f, int lane, const U8x4& q, float scale) {
  if (4 * lane < p.d) {
    float v[4];
    for (int i = 0; i < 4; ++i) v[i] = dequantize_byte(q.v[i], scale, dt, f);
    store4(unpack_dst(p, r, 0, 0) + 4 * lane * dtype_bytes(dt), v, dt);
  }
  dequantize_out_row_lane_from(p, r, dt, f, lane, s0 + 1, true);
}

}  // namespace ulysses_kernels
