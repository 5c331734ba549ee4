// CPU twin of pack.cu: the same index math (layout_math.h), one row at a time. Used for
// CPU tensors and, in CI, to check the index math bit-exact against the torch reference.
#include "pack.h"

#include <string.h>

namespace ulysses_kernels {

namespace {

template <class I>
void pack_rows(const PackParams& p) {
  const I rows = (I)p.peer_row0[p.n_peers];
  for (I row = 0; row < rows; ++row) {
    const RowCopy r = pack_row<I>(p, row);
    if (r.src_unit_stride == p.unit) {
      memcpy(r.dst, r.src, (size_t)p.row_bytes);
    } else {
      for (int64_t u = 0; u < p.units_per_row; ++u) memcpy(r.dst + u * p.unit, r.src + u * r.src_unit_stride, (size_t)p.unit);
    }
  }
}

// Each output row decoded once (unpack_row_copy, as the CUDA kernels' new variant does): a
// row held by one source is copied, one memcpy when D is contiguous on both sides; a row
// held by several is summed unit by unit in rank order. NOTE: the unpack of 2.2e9 one-byte
// units in tests/test_large_index.py took 27 s unit by unit, 3.7 s by rows (2-core CPU).
template <class Op, int UNIT, class I>
void unpack_rows_t(const UnpackParams& p, const HeadSpan& span) {
  const I rows = (I)(p.batch * p.seq * span.heads);
  const size_t row_bytes = (size_t)(p.units_per_row * p.unit);
  for (I row = 0; row < rows; ++row) {
    const OutRow r = unpack_out_row<I>(p, span, row);
    const UnpackRowCopy c = unpack_row_copy(p, r);
    if (c.kind == 1 && c.src_unit_stride == p.unit && c.dst_unit_stride == p.unit) {
      memcpy(c.dst, c.src, row_bytes);
    } else if (c.kind == 1) {
      for (int64_t u = 0; u < p.units_per_row; ++u) {
        memcpy(c.dst + u * c.dst_unit_stride, c.src + u * c.src_unit_stride, (size_t)p.unit);
      }
    } else if (c.kind == 2) {
      for (int64_t u = 0; u < p.units_per_row; ++u) unpack_unit<Op, UNIT>(p, r, u);
    }
  }
}

// The same index width the CUDA launch would use (pack.cu), unless forced wide.
bool narrow(int64_t work, bool force_wide) { return !force_wide && narrow_index(work); }

// Over the heads the sources hold only, as the CUDA launch does (unpack_head_span).
template <class Op, int UNIT>
void unpack_rows(const UnpackParams& p, bool force_wide) {
  const HeadSpan span = unpack_head_span(p);
  if (narrow(unpack_units(p, span), force_wide)) {
    unpack_rows_t<Op, UNIT, uint32_t>(p, span);
  } else {
    unpack_rows_t<Op, UNIT, int64_t>(p, span);
  }
}

template <class Op>
void unpack_dispatch_unit(const UnpackParams& p, bool wide) {
  switch (p.unit) {
    case 16: return unpack_rows<Op, 16>(p, wide);
    case 8: return unpack_rows<Op, 8>(p, wide);
    case 4: return unpack_rows<Op, 4>(p, wide);
    case 2: return unpack_rows<Op, 2>(p, wide);
    default: return unpack_rows<Op, 1>(p, wide);
  }
}

}  // namespace

void pack_cpu(const PackParams& p, bool force_wide_index) {
  if (narrow(p.peer_row0[p.n_peers] * p.units_per_row, force_wide_index)) {
    pack_rows<uint32_t>(p);
  } else {
    pack_rows<int64_t>(p);
  }
}

void unpack_cpu(const UnpackParams& p, AddType add, bool force_wide_index) {
  switch (add) {
    case AddType::kF32: return unpack_dispatch_unit<AddF32>(p, force_wide_index);
    case AddType::kF64: return unpack_dispatch_unit<AddF64>(p, force_wide_index);
    case AddType::kF16: return unpack_dispatch_unit<AddF16>(p, force_wide_index);
    case AddType::kBF16: return unpack_dispatch_unit<AddBF16>(p, force_wide_index);
    default: return unpack_dispatch_unit<CopyOnly>(p, force_wide_index);
  }
}

}  // namespace ulysses_kernels
