// Host-side types shared by every launcher declaration. Framework-free: CUDA runtime only.
#pragma once
#include <cuda_runtime.h>
#include <cstdint>

namespace minfer {

// Element types the kernels are instantiated for.
enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

}  // namespace minfer
