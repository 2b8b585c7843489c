// For .cu files whose kernels need sm_90a (wgmma, setmaxnreg): a plain sm_90 device pass is refused,
// MINFER_SM90A marks the pass that has the sm_90a features, and sm90a_kernel_available() is the run-time
// check that such a kernel can run on the current device. Included from .cu files only.
#pragma once
#include <cuda_runtime.h>

#include <atomic>

#include "sm90_pipeline.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "this file's kernels need the sm_90a target (wgmma, setmaxnreg): build for Hopper with TORCH_CUDA_ARCH_LIST=9.0a"
#endif
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MINFER_SM90A 1
#endif

namespace minfer {

// True when the current device is an sm_90 part, `Kernel` holds sm_90 machine code compiled from sm_90a
// PTX (the #error above rules out plain sm_90), and the driver can encode tensor maps. Asked once per device.
template <auto Kernel>
bool sm90a_kernel_available() {
    static std::atomic<int> cached[64] = {};  // 0 unknown, 1 no, 2 yes
    const int device = current_device();
    int state = cached[device].load(std::memory_order_relaxed);
    if (state == 0) {
        cudaDeviceProp prop;
        cudaFuncAttributes attr;
        const bool ok = cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9 && prop.minor == 0 &&
                        cudaFuncGetAttributes(&attr, Kernel) == cudaSuccess && attr.binaryVersion == 90 &&
                        attr.ptxVersion >= 90 && encode_tiled() != nullptr;
        state = ok ? 2 : 1;
        cached[device].store(state, std::memory_order_relaxed);
    }
    return state == 2;
}

}  // namespace minfer
