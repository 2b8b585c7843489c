// Dense projections: the decode GEMV (gemv.h) and the prefill HGEMM (hgemm.h).
// Each binding checks the tensors and forwards raw pointers to the framework-free launchers.
#include "common/torch_binding.h"
#include "dense/gemv.h"
#include "dense/hgemm.h"

namespace {

using namespace minfer::binding;

// The launch configuration pinned (kernels/dense/gemv.h, GemvTuning), for sweeps and their tests.
void gemv_tuned(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, const std::optional<at::Tensor>& norm_weight,
                double eps, bool accumulate, bool silu_mul, int64_t warps_per_block, int64_t unroll) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(w, "w");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "minfer.gemv: expects x [T, K], w [N, K], out [T, N]");
    const int64_t tokens = x.size(0), k = x.size(1), n = w.size(0);
    MINFER_CHECK(tokens >= 1 && tokens <= minfer::kGemvMaxTokens, "minfer.gemv: takes 1..", minfer::kGemvMaxTokens,
                " tokens, got ", tokens, "; use a GEMM for more");
    MINFER_CHECK(w.size(1) == k, "minfer.gemv: x has K=", k, " but w has K=", w.size(1));
    const int64_t outputs = silu_mul ? n / 2 : n;
    MINFER_CHECK(!silu_mul || (n % 2 == 0 && !accumulate),
                 "minfer.gemv: silu_mul needs w = [gate; up] with an even N, and no accumulate");
    MINFER_CHECK(out.size(0) == tokens && out.size(1) == outputs, "minfer.gemv: out must be [", tokens, ", ",
                 outputs, "]");
    MINFER_CHECK(n >= 1 && k >= 1 && n <= INT32_MAX && k <= INT32_MAX, "minfer.gemv: N and K must be in 1..2^31-1");
    MINFER_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == w.scalar_type(),
                "minfer.gemv: x, w and out must share one dtype");
    MINFER_CHECK(w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16,
                "minfer.gemv: float16 or bfloat16 only, got ", w.scalar_type());
    MINFER_CHECK(x.device() == w.device() && out.device() == w.device(), "minfer.gemv: tensors on different devices");
    MINFER_CHECK(warps_per_block == 0 || warps_per_block == 4 || warps_per_block == 8 || warps_per_block == 16,
                 "minfer.gemv: warps_per_block must be 0 (auto), 4, 8 or 16");
    MINFER_CHECK(unroll == 0 || unroll == 2 || unroll == 4 || (unroll == 8 && warps_per_block != 16),
                 "minfer.gemv: unroll must be 0 (auto), 2, 4 or 8 (8 only with fewer than 16 warps)");
    minfer::ProjectionFusion fusion = projection_fusion(norm_weight, eps, accumulate, x, out, k, "minfer.gemv");
    fusion.silu_mul = silu_mul;
    const c10::cuda::CUDAGuard guard(w.device());
    minfer::GemvTuning tuning;
    tuning.warps_per_block = (int)warps_per_block;
    tuning.unroll = (int)unroll;
    minfer::launch_gemv(x.data_ptr(), w.data_ptr(), out.data_ptr(), tokens, n, k, dtype_of(w), fusion, tuning,
                        current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gemv(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, const std::optional<at::Tensor>& norm_weight,
          double eps, bool accumulate, bool silu_mul) {
    gemv_tuned(x, w, out, norm_weight, eps, accumulate, silu_mul, 0, 0);
}

void run_hgemm(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, const std::string& kernel) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(w, "w");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "minfer.hgemm: expects x [M, K], w [N, K], out [M, N]");
    const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
    MINFER_CHECK(w.size(1) == k, "minfer.hgemm: x has K=", k, " but w has K=", w.size(1));
    MINFER_CHECK(out.size(0) == m && out.size(1) == n, "minfer.hgemm: out must be [", m, ", ", n, "]");
    MINFER_CHECK(n % 8 == 0 && k % 8 == 0, "minfer.hgemm: N and K must be multiples of 8, got N=", n, ", K=", k,
                "; pad the weight (and x) with zeros to the next multiple of 8");
    MINFER_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == w.scalar_type(),
                "minfer.hgemm: x, w and out must share one dtype");
    MINFER_CHECK(w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16,
                "minfer.hgemm: float16 or bfloat16 only, got ", w.scalar_type());
    MINFER_CHECK(x.device() == w.device() && out.device() == w.device(), "minfer.hgemm: tensors on different devices");
    const c10::cuda::CUDAGuard guard(w.device());
    const char* error = minfer::launch_hgemm(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k, dtype_of(w),
                                             kernel.c_str(), current_stream());
    MINFER_CHECK(error == nullptr, "minfer.hgemm: ", error);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void hgemm(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) { run_hgemm(x, w, out, "auto"); }

// The same with the kernel pinned by name (kernels/dense/hgemm.h), for tests and benchmarks.
void hgemm_tuned(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, c10::string_view kernel) {
    run_hgemm(x, w, out, std::string(kernel));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("gemv(Tensor x, Tensor w, Tensor(a!) out, Tensor? norm_weight=None, float eps=0.0, bool accumulate=False, "
          "bool silu_mul=False) -> ()");
    m.def("gemv_tuned(Tensor x, Tensor w, Tensor(a!) out, Tensor? norm_weight, float eps, bool accumulate, "
          "bool silu_mul, int warps_per_block, int unroll) -> ()");
    m.def("hgemm(Tensor x, Tensor w, Tensor(a!) out) -> ()");
    m.def("hgemm_tuned(Tensor x, Tensor w, Tensor(a!) out, str kernel) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("gemv", &gemv);
    m.impl("gemv_tuned", &gemv_tuned);
    m.impl("hgemm", &hgemm);
    m.impl("hgemm_tuned", &hgemm_tuned);
}
