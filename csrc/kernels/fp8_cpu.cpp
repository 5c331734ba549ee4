// CPU twin of fp8.cu: the same row functions (fp8_math.h) and index math (layout_math.h),
// one row at a time.
#include "fp8.h"

namespace ulysses_kernels {

void quant_pack_cpu(const PackParams& p, const Fp8Args& a) {
  const Fp8Format f = fp8_format(a.fmt);
  const int64_t rows = p.peer_row0[p.n_peers];
  for (int64_t row = 0; row < rows; ++row) {
    const RowCopy r = pack_row<int64_t>(p, row);  // src_unit_stride: the source's D stride (fp8_ops.cpp)
    quantize_row(r.src, r.src_unit_stride, a.dtype, a.d, r.dst, f);
  }
}

void dequant_unpack_cpu(const UnpackParams& p, const Fp8Args& a) {
  const Fp8Format f = fp8_format(a.fmt);
  const HeadSpan span = unpack_head_span(p);
  const int64_t rows = p.batch * p.seq * span.heads;
  for (int64_t row = 0; row < rows; ++row) dequantize_out_row(p, unpack_out_row<int64_t>(p, span, row), a.dtype, f);
}

}  // namespace ulysses_kernels
