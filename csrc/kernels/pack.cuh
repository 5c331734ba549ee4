// CUDA launchers of the fused pack and unpack (pack.cu). Torch-free: the caller passes
// the parameter structs by value and the stream to launch on; no host synchronization.
#pragma once

#include <cuda_runtime_api.h>

#include "pack.h"

namespace ulysses_kernels {

cudaError_t launch_pack(const PackParams& p, cudaStream_t stream);
// The unpack: every role of `m` in one launch.
cudaError_t launch_unpack_multi(const UnpackMulti& m, AddType add, cudaStream_t stream);

}  // namespace ulysses_kernels
