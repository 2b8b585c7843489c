#include "activation.h"
#include "common/device_utils.cuh"

namespace minfer {

namespace {

template <typename T>
__global__ void silu_mul_kernel(const T* gate_up, T* __restrict__ out, int64_t inter) {
    allow_dependents_to_launch();
    wait_for_previous_kernel();  // gate_up comes from the previous kernel: plain (not .nc) loads below
    const int64_t t = blockIdx.y;
    const T* gate = gate_up + t * 2 * inter;
    const T* up = gate + inter;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < inter;
         i += (int64_t)gridDim.x * blockDim.x) {
        const float g = to_float(gate[i]);
        const float u = to_float(up[i]);
        out[t * inter + i] = from_float<T>(g / (1.0f + __expf(-g)) * u);
    }
}

template <typename T>
void launch_typed(const void* gate_up, void* out, int64_t tokens, int64_t inter, cudaStream_t stream) {
    const int threads = 256;
    const int blocks_x = (int)((inter + threads - 1) / threads);
    dim3 grid(blocks_x < 1024 ? blocks_x : 1024, (unsigned)tokens);
    launch_with_pdl(silu_mul_kernel<T>, grid, dim3(threads), 0, stream, true, static_cast<const T*>(gate_up),
                    static_cast<T*>(out), inter);
}

}  // namespace

void launch_silu_mul(const void* gate_up, void* out, int64_t tokens, int64_t inter, DType dtype,
                     cudaStream_t stream) {
    switch (dtype) {
        case DType::kFloat16: launch_typed<half>(gate_up, out, tokens, inter, stream); break;
        case DType::kBFloat16: launch_typed<__nv_bfloat16>(gate_up, out, tokens, inter, stream); break;
        case DType::kFloat32: launch_typed<float>(gate_up, out, tokens, inter, stream); break;
    }
}

}  // namespace minfer
