// CPU twin of fp8.cu: the same lane functions (fp8_math.h), index math (layout_math.h) and
// row groups, one row at a time, its 32 lanes in turn (the row's amax: the max over the
// lanes' amaxes, as the warp's shuffle reduction).
#include "fp8.h"

namespace ulysses_kernels {

namespace {

// One row in two passes (fp8.cu's path for rows that are not register rows).
void quant_row_two_pass(const RowCopy& r, const Fp8Args& a, const Fp8Format& f) {
  const bool vec = fp8_row_vector(r.src, r.src_unit_stride, a.dtype, a.d, r.dst);
  float amax = 0;
  for (int lane = 0; lane < kWarp; ++lane) {
    const float m = quantize_row_lane_amax(r.src, r.src_unit_stride, a.dtype, a.d, vec, lane);
    amax = m > amax ? m : amax;
  }
  for (int lane = 0; lane < kWarp; ++lane) quantize_row_lane_store(r.src, r.src_unit_stride, a.dtype, a.d, r.dst, amax, f, vec, lane);
}

// One register row: each lane's 4 values kept (x), the amax over the lanes, then the stores.
void quant_row_in_registers(const RowCopy& r, const Fp8Args& a, const Fp8Format& f) {
  float x[kWarp][4], amax = 0;
  for (int lane = 0; lane < kWarp; ++lane) {
    const float m = quantize_regs_load(r, a.dtype, a.d, lane, x[lane]);
    amax = m > amax ? m : amax;
  }
  for (int lane = 0; lane < kWarp; ++lane) quantize_regs_store(r, a.d, lane, x[lane], amax, f);
}

}  // namespace

// fp8.cu's groups of kFp8RowsInFlight rows: register rows when all rows of the group are.
void quant_pack_cpu(const PackParams& p, const Fp8Args& a) {
  const Fp8Format f = fp8_format(a.fmt);
  const int64_t rows = p.peer_row0[p.n_peers];
  for (int64_t row0 = 0; row0 < rows; row0 += kFp8RowsInFlight) {
    const int n = rows - row0 < kFp8RowsInFlight ? (int)(rows - row0) : kFp8RowsInFlight;
    RowCopy r[kFp8RowsInFlight];  // src_unit_stride: the source's D stride (fp8_ops.cpp)
    bool regs = true;
    for (int i = 0; i < n; ++i) {
      r[i] = pack_row<int64_t>(p, row0 + i);
      regs = regs && fp8_row_in_registers(r[i], a.dtype, a.d);
    }
    for (int i = 0; i < n; ++i) {
      if (regs) {
        quant_row_in_registers(r[i], a, f);
      } else {
        quant_row_two_pass(r[i], a, f);
      }
    }
  }
}

void dequant_unpack_cpu(const UnpackParams& p, const Fp8Args& a) {
  const Fp8Format f = fp8_format(a.fmt);
  const HeadSpan span = unpack_head_span(p);
  const int64_t rows = p.batch * p.seq * span.heads;
  for (int64_t row0 = 0; row0 < rows; row0 += kFp8RowsInFlight) {  // fp8.cu's row groups
    const int n = rows - row0 < kFp8RowsInFlight ? (int)(rows - row0) : kFp8RowsInFlight;
    OutRow r[kFp8RowsInFlight];
    int s0[kFp8RowsInFlight];
    bool regs = true;
    for (int i = 0; i < n; ++i) {
      r[i] = unpack_out_row<int64_t>(p, span, row0 + i);
      s0[i] = first_holder(p, r[i].head);
      regs = regs && dequant_row_in_registers(p, r[i], a.dtype, s0[i]);
    }
    for (int i = 0; i < n; ++i) {
      if (!regs) {
        for (int lane = 0; lane < kWarp; ++lane) dequantize_out_row_lane(p, r[i], a.dtype, f, lane);
        continue;
      }
      U8x4 q[kWarp];
      float sc[kWarp];
      for (int lane = 0; lane < kWarp; ++lane) dequant_regs_load(p, r[i], s0[i], lane, q[lane], sc[lane]);
      for (int lane = 0; lane < kWarp; ++lane) dequant_regs_store(p, r[i], s0[i], a.dtype, f, lane, q[lane], sc[lane]);
    }
  }
}

}  // namespace ulysses_kernels
