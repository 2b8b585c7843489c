// The one binding layer: op schemas (TORCH_LIBRARY) and their CUDA implementations.
// Kernels themselves are framework-free; this file checks tensors and forwards raw pointers.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "activation.h"
#include "argmax.h"
#include "gemv.h"

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

void gemv(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(w, "w");
    check_cuda_contiguous(out, "out");
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "minfer.gemv: expects x [T, K], w [N, K], out [T, N]");
    const int64_t tokens = x.size(0), k = x.size(1), n = w.size(0);
    TORCH_CHECK(tokens >= 1 && tokens <= minfer::kGemvMaxTokens, "minfer.gemv: takes 1..", minfer::kGemvMaxTokens,
                " tokens, got ", tokens, "; use a GEMM for more");
    TORCH_CHECK(w.size(1) == k, "minfer.gemv: x has K=", k, " but w has K=", w.size(1));
    TORCH_CHECK(out.size(0) == tokens && out.size(1) == n, "minfer.gemv: out must be [", tokens, ", ", n, "]");
    TORCH_CHECK(n >= 1 && k >= 1 && n <= INT32_MAX && k <= INT32_MAX, "minfer.gemv: N and K must be in 1..2^31-1");
    TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == w.scalar_type(),
                "minfer.gemv: x, w and out must share one dtype");
    TORCH_CHECK(w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16,
                "minfer.gemv: float16 or bfloat16 only, got ", w.scalar_type());
    TORCH_CHECK(x.device() == w.device() && out.device() == w.device(), "minfer.gemv: tensors on different devices");
    const c10::cuda::CUDAGuard guard(w.device());
    minfer::launch_gemv(x.data_ptr(), w.data_ptr(), out.data_ptr(), tokens, n, k, dtype_of(w), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void argmax(const at::Tensor& logits, at::Tensor& out) {
    check_cuda_contiguous(logits, "logits");
    check_cuda_contiguous(out, "out");
    TORCH_CHECK(logits.dim() == 2, "minfer.argmax: expects logits [B, V]");
    TORCH_CHECK(out.dim() == 1 && out.size(0) == logits.size(0), "minfer.argmax: out must be [B]");
    TORCH_CHECK(out.scalar_type() == at::kLong, "minfer.argmax: out must be int64");
    TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) <= INT32_MAX, "minfer.argmax: V must be in 1..2^31-1");
    TORCH_CHECK(logits.device() == out.device(), "minfer.argmax: tensors on different devices");
    if (logits.size(0) == 0) return;
    const c10::cuda::CUDAGuard guard(logits.device());
    minfer::launch_argmax(logits.data_ptr(), out.data_ptr<int64_t>(), logits.size(0), logits.size(1),
                          dtype_of(logits), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(minfer, m) {
    m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
    m.def("gemv(Tensor x, Tensor w, Tensor(a!) out) -> ()");
    m.def("argmax(Tensor logits, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("silu_mul", &silu_mul);
    m.impl("gemv", &gemv);
    m.impl("argmax", &argmax);
}
