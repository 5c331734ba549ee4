// Entry points of the pack/unpack kernels: the CPU twin (pack_cpu.cpp) and the CUDA
// launchers (pack.cu). Torch-free: parameters are the structs of layout_math.h, filled and
// checked by the host layer (csrc/ops.cpp).
#pragma once

#include "layout_math.h"

namespace ulysses_kernels {

// How an unpack combines KV replicas (the element type of the sum).
enum class AddType { kCopyOnly = 0, kF32, kF64, kF16, kBF16 };

// force_wide_index: use 64-bit index math even where 32 bits suffice (for tests).
void pack_cpu(const PackParams& p, bool force_wide_index = false);
void unpack_cpu(const UnpackParams& p, AddType add, bool force_wide_index = false);

}  // namespace ulysses_kernels
