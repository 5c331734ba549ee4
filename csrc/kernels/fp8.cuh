// CUDA launchers of the FP8 wire's kernels (fp8.cu). Torch-free: parameters by value, the
// stream to launch on; no host synchronization.
#pragma once

#include <cuda_runtime_api.h>

#include "fp8.h"

namespace ulysses_kernels {

cudaError_t launch_quant_pack(const PackParams& p, const Fp8Args& a, cudaStream_t stream);
cudaError_t launch_dequant_unpack(const UnpackParams& p, const Fp8Args& a, cudaStream_t stream);

}  // namespace ulysses_kernels
