// CPU twin of pack.cu: the same index math (layout_math.h), one row at a time. Used for
// CPU tensors and, in CI, to check the index math bit-exact against the torch reference.
#include "pack.h"

#include <string.h>

namespace ulysses_kernels {

void pack_cpu(const PackParams& p) {
  const int64_t rows = p.peer_row0[p.n_peers];
  for (int64_t row = 0; row < rows; ++row) {
    const RowCopy r = pack_row(p, row);
    if (r.src_unit_stride == p.unit) {
      memcpy(r.dst, r.src, (size_t)p.row_bytes);
    } else {
      for (int64_t u = 0; u < p.units_per_row; ++u) memcpy(r.dst + u * p.unit, r.src + u * r.src_unit_stride, (size_t)p.unit);
    }
  }
}

namespace {

template <class Op, int UNIT>
void unpack_rows(const UnpackParams& p) {
  const int64_t rows = p.batch * p.seq * p.out_heads;
  for (int64_t row = 0; row < rows; ++row) {
    const OutRow r = unpack_out_row(p, row);
    for (int64_t u = 0; u < p.units_per_row; ++u) {
      if (!unpack_unit<Op, UNIT>(p, r, u)) break;  // no source holds this head
    }
  }
}

template <class Op>
void unpack_dispatch_unit(const UnpackParams& p) {
  switch (p.unit) {
    case 16: return unpack_rows<Op, 16>(p);
    case 8: return unpack_rows<Op, 8>(p);
    case 4: return unpack_rows<Op, 4>(p);
    case 2: return unpack_rows<Op, 2>(p);
    default: return unpack_rows<Op, 1>(p);
  }
}

}  // namespace

void unpack_cpu(const UnpackParams& p, AddType add) {
  switch (add) {
    case AddType::kF32: return unpack_dispatch_unit<AddF32>(p);
    case AddType::kF64: return unpack_dispatch_unit<AddF64>(p);
    case AddType::kF16: return unpack_dispatch_unit<AddF16>(p);
    case AddType::kBF16: return unpack_dispatch_unit<AddBF16>(p);
    default: return unpack_dispatch_unit<CopyOnly>(p);
  }
}

}  // namespace ulysses_kernels
