// CPU twin of fp8.cu: the same lane functions (fp8_math.h) and index math (layout_math.h),
// one row at a time, its 32 lanes in turn (the row's amax: the max over the lanes' amaxes, as
// the warp's shuffle reduction).
#include "fp8.h"

namespace ulysses_kernels {

void quant_pack_cpu(const PackParams& p, const Fp8Args& a) {
  const Fp8Format f = fp8_format(a.fmt);
  const int64_t rows = p.peer_row0[p.n_peers];
  for (int64_t row = 0; row < rows; ++row) {
    const RowCopy r = pack_row<int64_t>(p, row);  // src_unit_stride: the source's D stride (fp8_ops.cpp)
    const bool vec = fp8_row_vector(r.src, r.src_unit_stride, a.dtype, a.d, r.dst);
    float amax = 0;
    for (int lane = 0; lane < kWarp; ++lane) {
      const float m = quantize_row_lane_amax(r.src, r.src_unit_stride, a.dtype, a.d, vec, lane);
      amax = m > amax ? m : amax;
    }
    for (int lane = 0; lane < kWarp; ++lane) quantize_row_lane_store(r.src, r.src_unit_stride, a.dtype, a.d, r.dst, amax, f, vec, lane);
  }
}

void dequant_unpack_cpu(const UnpackParams& p, const Fp8Args& a) {
  const Fp8Format f = fp8_format(a.fmt);
  const HeadSpan span = unpack_head_span(p);
  const int64_t rows = p.batch * p.seq * span.heads;
  for (int64_t row = 0; row < rows; ++row) {
    const OutRow r = unpack_out_row<int64_t>(p, span, row);
    for (int lane = 0; lane < kWarp; ++lane) dequantize_out_row_lane(p, r, a.dtype, f, lane);
  }
}

}  // namespace ulysses_kernels
