// Device helpers shared by the HGEMM kernels (include from .cu files only).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "common/device_utils.cuh"  // pack2

namespace minfer {

struct TileCoord {
    int m;  // tile row (block of M)
    int n;  // tile column (block of N)
};

// Tiles run in bands of `band` tile rows; inside a band, down M first, then across N. The tiles
// in flight at once then share a few x row-panels and w column-panels, which stay in L2.
__device__ __forceinline__ TileCoord tile_coord(int tile, int tiles_m, int tiles_n, int band) {
    const int per_band = band * tiles_n;
    const int first_m = (tile / per_band) * band;
    const int rows = min(band, tiles_m - first_m);
    const int in_band = tile % per_band;
    return {first_m + in_band % rows, in_band / rows};
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Raises a kernel's dynamic shared-memory limit, once per device: later calls, which may come while a
// CUDA graph is being captured, make no runtime call.
template <auto Kernel>
bool opt_in_shared_memory(int bytes) {
    static std::atomic<uint64_t> devices_done{0};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return false;
    const uint64_t bit = 1ull << (device & 63);
    if (devices_done.load(std::memory_order_acquire) & bit) return true;
    if (cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) return false;
    devices_done.fetch_or(bit, std::memory_order_release);
    return true;
}

}  // namespace minfer
