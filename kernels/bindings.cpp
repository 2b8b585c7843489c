// The one binding layer: op schemas (TORCH_LIBRARY) and their CUDA implementations.
// Kernels themselves are framework-free; this file checks tensors and forwards raw pointers.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "activation.h"

namespace {

using minfer::DType;

DType dtype_of(const at::Tensor& t) {
    switch (t.scalar_type()) {
        case at::kHalf: return DType::kFloat16;
        case at::kBFloat16: return DType::kBFloat16;
        case at::kFloat: return DType::kFloat32;
        default: TORCH_CHECK(false, "minfer: unsupported dtype ", t.scalar_type(), " (float16, bfloat16, float32)");
    }
}

void check_cuda_contiguous(const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), "minfer: ", name, " must be a CUDA tensor");
    TORCH_CHECK(t.is_contiguous(), "minfer: ", name, " must be contiguous");
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
    check_cuda_contiguous(gate_up, "gate_up");
    check_cuda_contiguous(out, "out");
    TORCH_CHECK(gate_up.scalar_type() == out.scalar_type(), "minfer.silu_mul: dtype mismatch");
    const int64_t inter = out.size(-1);
    TORCH_CHECK(gate_up.size(-1) == 2 * inter, "minfer.silu_mul: gate_up last dim must be 2x out's");
    TORCH_CHECK(gate_up.numel() == 2 * out.numel(), "minfer.silu_mul: leading dims differ");
    const c10::cuda::CUDAGuard guard(gate_up.device());
    minfer::launch_silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() / inter, inter, dtype_of(out),
                            current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(minfer, m) {
    m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("silu_mul", &silu_mul);
}
