// Entry points of the FP8 wire's kernels (fp8_math.h): the CPU twin (fp8_cpu.cpp) and the
// CUDA launchers (fp8.cu). Torch-free; the host layer (csrc/fp8_ops.cpp) fills and checks
// the parameters.
//
// The quantizing pack takes the PackParams of the plain pack (layout_math.h pack_row) with
// row_bytes = D + 4, the wire row: each send-buffer row is one (peer, batch, token, head)
// of D source elements quantized into D + 4 bytes. The dequantizing unpack takes the
// UnpackParams of the plain unpack with the wire blocks' byte strides.
#pragma once

#include "fp8_math.h"

namespace ulysses_kernels {

struct Fp8Args {
  int64_t d;  // elements per head (the row's D)
  int dtype;  // Fp8Dtype of the attention tensors
  int fmt;    // 0 e4m3, 1 e5m2
};

void quant_pack_cpu(const PackParams& p, const Fp8Args& a);
void dequant_unpack_cpu(const UnpackParams& p, const Fp8Args& a);

}  // namespace ulysses_kernels
