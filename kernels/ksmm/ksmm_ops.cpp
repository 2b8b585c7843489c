// KS factor products (ksmm.h): the binding checks the tensors and forwards raw pointers.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "common/torch_binding.h"
#include "ksmm/ksmm.h"

namespace {

using namespace minfer::binding;

struct FactorShape {
    int64_t tokens, a, b, c, d;
};

// The pattern and batch of a factor product, its tensors checked: x [T, a*c*d], the (a, b, c, d) factor and
// out [T, outputs] (a*b*d, or half of it with silu_mul) contiguous on one device in one 16-bit float dtype.
FactorShape check_factor_product(const at::Tensor& x, const at::Tensor& factor, const at::Tensor& out,
                                 bool silu_mul, const char* op) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(factor, "factor");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(factor.dim() == 4, op, ": factor must be a 4-D (a, b, c, d) tensor, got ", factor.sizes());
    const int64_t a = factor.size(0), b = factor.size(1), c = factor.size(2), d = factor.size(3);
    MINFER_CHECK(x.dim() == 2 && x.size(1) == a * c * d, op, ": x must be [T, ", a * c * d, "] for the pattern ",
                 factor.sizes(), ", got ", x.sizes());
    const int64_t tokens = x.size(0), outputs = silu_mul ? a * b * d / 2 : a * b * d;
    MINFER_CHECK(out.dim() == 2 && out.size(0) == tokens && out.size(1) == outputs, op, ": out must be [", tokens,
                 ", ", outputs, "], got ", out.sizes());
    MINFER_CHECK(factor.scalar_type() == at::kHalf || factor.scalar_type() == at::kBFloat16, op,
                 ": the factor must be float16 or bfloat16, got ", factor.scalar_type());
    MINFER_CHECK(x.scalar_type() == factor.scalar_type() && out.scalar_type() == factor.scalar_type(), op,
                 ": x, factor and out must share one dtype");
    MINFER_CHECK(x.device() == factor.device() && out.device() == factor.device(), op,
                 ": tensors on different devices");
    MINFER_CHECK(a <= INT32_MAX && b <= INT32_MAX && c <= INT32_MAX && d <= INT32_MAX && tokens <= INT32_MAX &&
                     a * b <= INT32_MAX && c * d <= INT32_MAX,
                 op, ": the pattern or the batch is too large for the kernel's int32 indices");
    MINFER_CHECK(at::get_overlap_status(x, out) == at::MemOverlapStatus::No, op,
                 ": out must not overlap x (other blocks still read x while one writes out)");
    return {tokens, a, b, c, d};
}

// `path`: 0 auto, 1 generic, 2 rows, 3 tensor cores, 4 gemv, 5 wgmma (minfer::KsmmPath), for tests and benchmarks.
void ksmm_tuned(const at::Tensor& x, const at::Tensor& factor, at::Tensor& out, int64_t path) {
    const char* op = "minfer.ksmm";
    const auto [tokens, a, b, c, d] = check_factor_product(x, factor, out, false, op);
    MINFER_CHECK(path >= 0 && path <= 5, op,
                 ": path must be 0 (auto), 1 (generic), 2 (rows), 3 (tensor cores), 4 (gemv) or 5 (wgmma)");
    const auto chosen = static_cast<minfer::KsmmPath>(path);
    MINFER_CHECK(minfer::ksmm_path_supports(chosen, tokens, a, b, c, d, x.data_ptr(), factor.data_ptr(),
                                            out.data_ptr()),
                 op, ": path ", path, " cannot run the pattern ", factor.sizes(), " for ", tokens,
                 " tokens (gemv and rows: at most ", minfer::kKsmmRowsMaxTokens,
                 " tokens; rows: d a power of two up to ", minfer::kKsmmRowsMaxD,
                 "; tensor cores, gemv: d 1, 2, 4 or a multiple of 8; all those: c*d a multiple of 8 and 16-byte ",
                 "aligned tensors; wgmma: d == 1, b and c multiples of ", minfer::kKsmmWgmmaMultiple,
                 ", an sm_90 GPU)");
    const c10::cuda::CUDAGuard guard(x.device());
    minfer::launch_ksmm(x.data_ptr(), factor.data_ptr(), out.data_ptr(), tokens, a, b, c, d, chosen,
                        dtype_of(factor), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ksmm(const at::Tensor& x, const at::Tensor& factor, at::Tensor& out) { ksmm_tuned(x, factor, out, 0); }

// A factor of a decode projection on the gemv kernel with its fusions (ksmm.h, launch_ksmm_gemv): the norm
// weight g [a*c*d] on the chain's first factor, accumulate (the residual add) or silu_mul on its last.
void ksmm_gemv(const at::Tensor& x, const at::Tensor& factor, at::Tensor& out,
               const std::optional<at::Tensor>& norm_weight, double eps, bool accumulate, bool silu_mul) {
    const char* op = "minfer.ksmm_gemv";
    const auto [tokens, a, b, c, d] = check_factor_product(x, factor, out, silu_mul, op);
    minfer::ProjectionFusion fusion = projection_fusion(norm_weight, eps, accumulate, x, out, a * c * d, op);
    fusion.silu_mul = silu_mul;
    MINFER_CHECK(minfer::ksmm_gemv_fusion_supports(tokens, a, b, c, d, x.data_ptr(), factor.data_ptr(),
                                                   out.data_ptr(), fusion),
                 op, ": the gemv kernel cannot run the pattern ", factor.sizes(), " for ", tokens, " tokens (1 to ",
                 minfer::kKsmmRowsMaxTokens, " tokens, d 1, 2, 4 or a multiple of 8, c*d a multiple of 8, 16-byte ",
                 "aligned tensors; silu_mul: a == 1, b even and no accumulate)");
    const c10::cuda::CUDAGuard guard(x.device());
    minfer::launch_ksmm_gemv(x.data_ptr(), factor.data_ptr(), out.data_ptr(), tokens, a, b, c, d, fusion,
                             dtype_of(factor), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out = x with each of its contiguous [rows][cols] blocks transposed (ksmm.h, launch_ksmm_transpose_blocks): x and
// out contiguous 16-bit tensors of one shape, not overlapping, their element count a multiple of rows * cols.
void transpose_blocks_into(const at::Tensor& x, at::Tensor& out, int64_t rows, int64_t cols, const char* op) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op,
                 ": x must be float16 or bfloat16, got ", x.scalar_type());
    MINFER_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && out.device() == x.device(), op,
                 ": out must have x's shape, dtype and device");
    MINFER_CHECK(rows >= 1 && cols >= 1 && rows <= INT32_MAX && cols <= INT32_MAX && x.numel() % (rows * cols) == 0,
                 op, ": blocks of ", rows, " x ", cols, " do not tile ", x.numel(), " elements");
    MINFER_CHECK(at::get_overlap_status(x, out) == at::MemOverlapStatus::No, op, ": out must not overlap x");
    const c10::cuda::CUDAGuard guard(x.device());
    if (!minfer::ksmm_transpose_blocks_supports(rows, cols, x.data_ptr(), out.data_ptr())) {
        out.copy_(x.view({-1, rows, cols}).transpose(1, 2).reshape(x.sizes()));  // shapes no KS kernel path makes
        return;
    }
    minfer::launch_ksmm_transpose_blocks(x.data_ptr(), out.data_ptr(), x.numel() / (rows * cols), rows, cols,
                                         current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void ksmm_transpose_blocks(const at::Tensor& x, int64_t rows, int64_t cols, at::Tensor& out) {
    transpose_blocks_into(x, out, rows, cols, "minfer.ksmm_transpose_blocks");
}

// A factor as groups of GEMMs on the sm_90a wgmma kernel (ksmm.h, launch_ksmm_wgmma): x [T, G*c] (a d > 1
// factor's batch-major order), groups [G, b, c] (the factor, or its per-l layout), out [T, G*b] in the factor's
// natural order (next_d == 1) or the batch-major order of a next factor with that (c, d); `op` names the caller.
void run_ksmm_wgmma(const at::Tensor& x, const at::Tensor& groups, at::Tensor& out, int64_t d, int64_t next_c,
                    int64_t next_d, int64_t tile_n, const char* op) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(groups, "groups");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(groups.dim() == 3, op, ": groups must be a 3-D [G, b, c] tensor, got ", groups.sizes());
    const int64_t g = groups.size(0), b = groups.size(1), c = groups.size(2);
    MINFER_CHECK(x.dim() == 2 && x.size(1) == g * c, op, ": x must be [T, ", g * c, "] for groups ", groups.sizes(),
                 ", got ", x.sizes());
    const int64_t tokens = x.size(0);
    MINFER_CHECK(out.dim() == 2 && out.size(0) == tokens && out.size(1) == g * b, op, ": out must be [", tokens,
                 ", ", g * b, "], got ", out.sizes());
    MINFER_CHECK(groups.scalar_type() == at::kHalf || groups.scalar_type() == at::kBFloat16, op,
                 ": groups must be float16 or bfloat16, got ", groups.scalar_type());
    MINFER_CHECK(x.scalar_type() == groups.scalar_type() && out.scalar_type() == groups.scalar_type(), op,
                 ": x, groups and out must share one dtype");
    MINFER_CHECK(x.device() == groups.device() && out.device() == groups.device(), op,
                 ": tensors on different devices");
    MINFER_CHECK(d >= 1 && g % d == 0, op, ": d must be >= 1 and divide the ", g, " groups, got ", d);
    MINFER_CHECK(next_d >= 1 && (next_d == 1 || (next_c >= 1 && (g * b) % (next_c * next_d) == 0)), op,
                 ": the next factor's (c, d) = (", next_c, ", ", next_d, ") does not chain with ", g * b, " outputs");
    MINFER_CHECK(tile_n == 0 || tile_n == 64 || tile_n == 128 || tile_n == 192 || tile_n == 256, op,
                 ": tile_n must be 0 (by shape), 64, 128, 192 or 256, got ", tile_n);
    MINFER_CHECK(at::get_overlap_status(x, out) == at::MemOverlapStatus::No, op, ": out must not overlap x");
    MINFER_CHECK(minfer::ksmm_wgmma_supports(tokens, g, b, c, x.data_ptr(), groups.data_ptr(), out.data_ptr()), op,
                 ": the wgmma kernel cannot run groups ", groups.sizes(), " for ", tokens,
                 " tokens (it needs an sm_90 ",
                 "GPU and a 9.0a build, b and c multiples of ", minfer::kKsmmWgmmaMultiple,
                 ", 16-byte aligned x, groups and out)");
    const c10::cuda::CUDAGuard guard(x.device());
    // Past the ksmm.h thresholds the GEMMs write the batch-major order [T][a][d][b] and one pass transposes it.
    const bool transposed = next_d == 1 && d >= minfer::kKsmmWgmmaTransposeMinD &&
                            tokens * d >= minfer::kKsmmWgmmaTransposeMinTokensD;
    at::Tensor grouped = transposed ? at::empty_like(out) : out;
    const char* error = minfer::launch_ksmm_wgmma(
        x.data_ptr(), groups.data_ptr(), grouped.data_ptr(), tokens, g, b, c, transposed ? 1 : d, next_c, next_d,
        static_cast<int>(tile_n), dtype_of(groups), current_stream());
    MINFER_CHECK(error == nullptr, op, ": ", error);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (transposed) transpose_blocks_into(grouped, out, d, b, op);
}

void ksmm_wgmma(const at::Tensor& x, const at::Tensor& groups, at::Tensor& out, int64_t d, int64_t next_c,
                int64_t next_d, int64_t tile_n) {
    run_ksmm_wgmma(x, groups, out, d, next_c, next_d, tile_n, "minfer.ksmm_wgmma");
}

// A KS chain whose factors all run the wgmma kernel, as one op: a prefill enqueues one dispatch per projection
// instead of one per factor (its host time was the prefill's bound). Factor i runs groups[i] with plan[5i ..
// 5i + 4] = (d, next_c, next_d, gather_c, gather_d); gather_d != 0 first copies x into the batch-major order of a
// factor with that (c, d) (ops.to_batch_major). Returns the last factor's output.
at::Tensor ksmm_wgmma_chain(const at::Tensor& x, at::TensorList groups, at::IntArrayRef plan) {
    const char* op = "minfer.ksmm_wgmma_chain";
    const int64_t factors = static_cast<int64_t>(groups.size());
    MINFER_CHECK(factors >= 1, op, ": groups must hold at least one factor");
    MINFER_CHECK(static_cast<int64_t>(plan.size()) == 5 * factors, op,
                 ": plan must hold (d, next_c, next_d, gather_c, gather_d) per factor, ", 5 * factors,
                 " integers for ", factors, " groups, got ", static_cast<int64_t>(plan.size()));
    MINFER_CHECK(x.dim() == 2, op, ": x must be a 2-D [T, inputs] tensor, got ", x.sizes());
    at::Tensor flat = x;
    for (int64_t i = 0; i < factors; ++i) {
        const int64_t* step = plan.data() + 5 * i;
        const int64_t gather_c = step[3], gather_d = step[4], tokens = flat.size(0);
        if (gather_d != 0) {
            const int64_t inputs = flat.size(1);
            MINFER_CHECK(gather_c >= 1 && gather_d >= 1 && inputs % (gather_c * gather_d) == 0, op, ": factor ", i,
                         "'s gather (c, d) = (", gather_c, ", ", gather_d, ") does not divide its ", inputs, " inputs");
            at::Tensor gathered = at::empty_like(flat);
            transpose_blocks_into(flat.contiguous(), gathered, gather_c, gather_d, op);
            flat = gathered;
        }
        const at::Tensor& weights = groups[i];
        MINFER_CHECK(weights.dim() == 3, op, ": groups[", i, "] must be a 3-D [G, b, c] tensor, got ",
                     weights.sizes());
        at::Tensor out = at::empty({tokens, weights.size(0) * weights.size(1)}, flat.options());
        run_ksmm_wgmma(flat, weights, out, step[0], step[1], step[2], 0, op);
        flat = out;
    }
    return flat;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("ksmm(Tensor x, Tensor factor, Tensor(a!) out) -> ()");
    m.def("ksmm_tuned(Tensor x, Tensor factor, Tensor(a!) out, int path) -> ()");
    m.def("ksmm_gemv(Tensor x, Tensor factor, Tensor(a!) out, Tensor? norm_weight=None, float eps=0.0, "
          "bool accumulate=False, bool silu_mul=False) -> ()");
    m.def("ksmm_wgmma(Tensor x, Tensor groups, Tensor(a!) out, int d, int next_c, int next_d, int tile_n=0) -> ()");
    m.def("ksmm_wgmma_chain(Tensor x, Tensor[] groups, int[] plan) -> Tensor");
    m.def("ksmm_transpose_blocks(Tensor x, int rows, int cols, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("ksmm", &ksmm);
    m.impl("ksmm_tuned", &ksmm_tuned);
    m.impl("ksmm_gemv", &ksmm_gemv);
    m.impl("ksmm_wgmma", &ksmm_wgmma);
    m.impl("ksmm_wgmma_chain", &ksmm_wgmma_chain);
    m.impl("ksmm_transpose_blocks", &ksmm_transpose_blocks);
}
