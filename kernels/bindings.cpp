// The one binding layer: op schemas (TORCH_LIBRARY) and their CUDA implementations.
// Kernels themselves are framework-free; this file checks tensors and forwards raw pointers.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "activation.h"
#include "argmax.h"
#include "gemv.h"
#include "hgemm.h"
#include "macko.h"
#include "decode_attention.h"
#include "embedding.h"
#include "rms_norm.h"
#include "rope.h"

namespace {

using minfer::DType;

// Error text for MINFER_CHECK, built in a fixed buffer with snprintf. On the device image, a
// TORCH_CHECK whose message streamed an integer (c10::str) crashed the process instead of
// raising; literal-only messages raised cleanly, so every check hands torch a plain C string.
struct CheckMessage {
    char text[512] = {};
    size_t used = 0;

    void add(const char* s) { append("%s", s); }
    void add(const std::string& s) { add(s.c_str()); }
    void add(int64_t v) { append("%lld", static_cast<long long>(v)); }
    void add(c10::ScalarType t) { add(c10::toString(t)); }
    void add(c10::IntArrayRef dims) {
        add("[");
        for (size_t i = 0; i < dims.size(); ++i) {
            if (i) add(", ");
            add(dims[i]);
        }
        add("]");
    }

    template <typename... Args>
    void append(const char* format, Args... args) {
        if (used + 1 >= sizeof(text)) return;
        const int n = std::snprintf(text + used, sizeof(text) - used, format, args...);
        if (n > 0) used = std::min(sizeof(text) - 1, used + static_cast<size_t>(n));
    }
};

template <typename... Args>
CheckMessage check_message(const Args&... args) {
    CheckMessage message;
    (message.add(args), ...);
    return message;
}

#define MINFER_CHECK(cond, ...)                                                     \
    do {                                                                            \
        if (!(cond)) {                                                              \
            const CheckMessage minfer_check_message_ = check_message(__VA_ARGS__);  \
            TORCH_CHECK(false, static_cast<const char*>(minfer_check_message_.text)); \
        }                                                                           \
    } while (0)

// `what` names the argument in the error, e.g. "minfer.embedding: table".
DType dtype_of(const at::Tensor& t, const char* what = "minfer") {
    switch (t.scalar_type()) {
        case at::kHalf: return DType::kFloat16;
        case at::kBFloat16: return DType::kBFloat16;
        case at::kFloat: return DType::kFloat32;
        default: MINFER_CHECK(false, what, ": unsupported dtype ", t.scalar_type(), " (float16, bfloat16, float32)");
    }
}

void check_cuda_contiguous(const at::Tensor& t, const char* name) {
    MINFER_CHECK(t.is_cuda(), "minfer: ", name, " must be a CUDA tensor");
    MINFER_CHECK(t.is_contiguous(), "minfer: ", name, " must be contiguous");
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
    check_cuda_contiguous(gate_up, "gate_up");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(gate_up.scalar_type() == out.scalar_type(), "minfer.silu_mul: dtype mismatch");
    const int64_t inter = out.size(-1);
    MINFER_CHECK(gate_up.size(-1) == 2 * inter, "minfer.silu_mul: gate_up last dim must be 2x out's");
    MINFER_CHECK(gate_up.numel() == 2 * out.numel(), "minfer.silu_mul: leading dims differ");
    const c10::cuda::CUDAGuard guard(gate_up.device());
    minfer::launch_silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() / inter, inter, dtype_of(out),
                            current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fusions of a decode projection (launch.h) from the optional norm weight and the accumulate flag.
minfer::ProjectionFusion projection_fusion(const std::optional<at::Tensor>& norm_weight, double eps, bool accumulate,
                                           const at::Tensor& x, const at::Tensor& out, int64_t k, const char* op) {
    minfer::ProjectionFusion fusion;
    if (norm_weight.has_value()) {
        check_cuda_contiguous(*norm_weight, "norm_weight");
        MINFER_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == k, op, ": norm_weight must be [", k, "]");
        MINFER_CHECK(norm_weight->scalar_type() == x.scalar_type() && norm_weight->device() == x.device(), op,
                     ": norm_weight must have x's dtype and device");
        MINFER_CHECK(eps >= 0.0, op, ": eps must be >= 0");
        fusion.norm_weight = norm_weight->data_ptr();
        fusion.eps = (float)eps;
    }
    fusion.accumulate = accumulate;
    MINFER_CHECK(at::get_overlap_status(x, out) == at::MemOverlapStatus::No, op,
                 ": out must not overlap x (other blocks still read x while one writes out)");
    return fusion;
}

void gemv(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, const std::optional<at::Tensor>& norm_weight,
          double eps, bool accumulate, int64_t warps_per_block, int64_t unroll, bool silu_mul) {
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

void embedding(const at::Tensor& table, const at::Tensor& tokens, at::Tensor& out) {
    check_cuda_contiguous(tokens, "tokens");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(table.dim() == 2 && table.is_contiguous(), "minfer.embedding: table must be a contiguous [V, D] matrix");
    MINFER_CHECK((table.is_cuda() && table.device() == tokens.device()) || (table.is_cpu() && table.is_pinned()),
                 "minfer.embedding: table must be on the tokens' GPU or in pinned host memory");
    dtype_of(table, "minfer.embedding: table");  // refuses anything but float16, bfloat16 and float32
    MINFER_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "minfer.embedding: tokens must be 1-D int64");
    MINFER_CHECK(out.dim() == 2 && out.size(0) == tokens.size(0) && out.size(1) == table.size(1),
                 "minfer.embedding: out must be [tokens, D]");
    MINFER_CHECK(out.scalar_type() == table.scalar_type(), "minfer.embedding: out must have the table's dtype");
    MINFER_CHECK(out.device() == tokens.device(), "minfer.embedding: out must be on the tokens' device");
    MINFER_CHECK(tokens.size(0) <= INT32_MAX, "minfer.embedding: too many tokens");
    const c10::cuda::CUDAGuard guard(tokens.device());
    minfer::launch_embedding(table.data_ptr(), tokens.data_ptr<int64_t>(), out.data_ptr(), tokens.size(0),
                             table.size(0), table.size(1) * (int64_t)table.element_size(), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void argmax(const at::Tensor& logits, at::Tensor& out, const std::optional<at::Tensor>& position,
            const std::optional<at::Tensor>& host_tokens) {
    check_cuda_contiguous(logits, "logits");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(logits.dim() == 2, "minfer.argmax: expects logits [B, V]");
    MINFER_CHECK(out.dim() == 1 && out.size(0) == logits.size(0), "minfer.argmax: out must be [B]");
    MINFER_CHECK(out.scalar_type() == at::kLong, "minfer.argmax: out must be int64");
    MINFER_CHECK(logits.size(1) >= 1 && logits.size(1) <= INT32_MAX, "minfer.argmax: V must be in 1..2^31-1");
    MINFER_CHECK(logits.device() == out.device(), "minfer.argmax: tensors on different devices");
    MINFER_CHECK(position.has_value() == host_tokens.has_value(),
                 "minfer.argmax: position and host_tokens go together (the token hand-off)");
    minfer::TokenHandoff handoff;
    if (position.has_value()) {
        check_cuda_contiguous(*position, "position");
        MINFER_CHECK(position->numel() == 1 && position->scalar_type() == at::kLong && position->device() == out.device(),
                     "minfer.argmax: position must be one int64 on the logits' device");
        MINFER_CHECK(host_tokens->device().is_cpu() && host_tokens->is_pinned() && host_tokens->dim() == 1 &&
                         host_tokens->is_contiguous() && host_tokens->scalar_type() == at::kLong,
                     "minfer.argmax: host_tokens must be a contiguous 1-D int64 tensor in pinned host memory");
        MINFER_CHECK(logits.size(0) == 1, "minfer.argmax: the token hand-off takes one row of logits");
        handoff.position = position->data_ptr<int64_t>();
        handoff.host_tokens = host_tokens->data_ptr<int64_t>();
        handoff.capacity = host_tokens->numel();
    }
    if (logits.size(0) == 0) return;
    const c10::cuda::CUDAGuard guard(logits.device());
    minfer::launch_argmax(logits.data_ptr(), out.data_ptr<int64_t>(), logits.size(0), logits.size(1),
                          dtype_of(logits), handoff, current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}


void check_macko(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr, const char* op) {
    check_cuda_contiguous(values, "values");
    check_cuda_contiguous(deltas, "deltas");
    check_cuda_contiguous(row_ptr, "row_ptr");
    MINFER_CHECK(values.dim() == 1 && deltas.dim() == 1 && row_ptr.dim() == 1, op, ": values, deltas, row_ptr must be 1-D");
    MINFER_CHECK(values.scalar_type() == at::kHalf || values.scalar_type() == at::kBFloat16, op,
                ": values must be float16 or bfloat16, got ", values.scalar_type());
    MINFER_CHECK(deltas.scalar_type() == at::kByte, op, ": deltas must be uint8");
    MINFER_CHECK(row_ptr.scalar_type() == at::kInt, op, ": row_ptr must be int32");
    MINFER_CHECK(values.numel() % 8 == 0 && deltas.numel() * 2 == values.numel(), op,
                ": values must hold a multiple of 8 entries and deltas half as many bytes");
    MINFER_CHECK(values.numel() < INT32_MAX && row_ptr.numel() >= 1 && row_ptr.numel() <= INT32_MAX, op,
                ": the matrix is too large for int32 indices");
    MINFER_CHECK(reinterpret_cast<uintptr_t>(values.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(deltas.data_ptr()) % 4 == 0,
                op, ": values must be 16-byte and deltas 4-byte aligned (clone them)");
    MINFER_CHECK(deltas.device() == values.device() && row_ptr.device() == values.device(), op,
                ": tensors on different devices");
}

void macko_spmv(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr, const at::Tensor& x,
                at::Tensor& out, const std::optional<at::Tensor>& norm_weight, double eps, int64_t steps,
                int64_t warps_per_block, int64_t x_in_smem, int64_t pipeline, bool accumulate, bool silu_mul) {
    check_macko(values, deltas, row_ptr, "minfer.macko_spmv");
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(x.dim() == 2 && out.dim() == 2, "minfer.macko_spmv: expects x [T, K] and out [T, N]");
    const int64_t rows = row_ptr.numel() - 1, cols = x.size(1), tokens = x.size(0);
    const int64_t outputs = silu_mul ? rows / 2 : rows;
    MINFER_CHECK(out.size(0) == tokens && out.size(1) == outputs, "minfer.macko_spmv: out must be [", tokens, ", ",
                 outputs, "]");
    MINFER_CHECK(cols <= INT32_MAX && tokens <= INT32_MAX, "minfer.macko_spmv: x is too large");
    MINFER_CHECK(x.scalar_type() == values.scalar_type() && out.scalar_type() == values.scalar_type(),
                "minfer.macko_spmv: values, x and out must share one dtype");
    MINFER_CHECK(x.device() == values.device() && out.device() == values.device(),
                "minfer.macko_spmv: tensors on different devices");
    MINFER_CHECK(at::get_overlap_status(x, out) == at::MemOverlapStatus::No,
                 "minfer.macko_spmv: out must not overlap x (other blocks still read x while one writes out)");
    MINFER_CHECK(steps == 0 || steps == 1 || steps == 2, "minfer.macko_spmv: steps must be 0 (auto), 1 or 2");
    MINFER_CHECK(warps_per_block == 0 || warps_per_block == 4 || warps_per_block == 8 || warps_per_block == 16,
                "minfer.macko_spmv: warps_per_block must be 0 (auto), 4, 8 or 16");
    minfer::MackoNorm norm;
    if (norm_weight) {
        check_cuda_contiguous(*norm_weight, "norm_weight");
        MINFER_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == cols &&
                         norm_weight->scalar_type() == values.scalar_type() && norm_weight->device() == values.device(),
                     "minfer.macko_spmv: norm_weight must be [", cols, "] in the values' dtype, on their device");
        norm.weight = norm_weight->data_ptr();
        norm.eps = (float)eps;
    }
    MINFER_CHECK(!silu_mul || (rows % 2 == 0 && !accumulate), "minfer.macko_spmv: silu_mul needs a [gate; up] matrix ",
                 "(an even number of rows, got ", rows, ") and no accumulate");
    MINFER_CHECK((!norm_weight && !silu_mul) ||
                     (tokens == 1 && cols <= minfer::kMackoFusedMaxCols && pipeline != 0 && x_in_smem != 0),
                 "minfer.macko_spmv: the norm and silu_mul are fused for one token of at most ",
                 minfer::kMackoFusedMaxCols, " columns on the pipelined kernel with x in shared memory (got ", tokens,
                 " tokens of ", cols, " columns); run rms_norm before or silu_mul after the SpMV otherwise");
    const c10::cuda::CUDAGuard guard(values.device());
    minfer::MackoTuning tuning;
    tuning.steps = (int)steps;
    tuning.warps_per_block = (int)warps_per_block;
    tuning.x_in_smem = (int)x_in_smem;
    tuning.pipeline = (int)pipeline;
    minfer::launch_macko_spmv(values.data_ptr(), deltas.data_ptr<uint8_t>(), row_ptr.data_ptr<int32_t>(),
                              x.data_ptr(), out.data_ptr(), rows, cols, tokens, accumulate, norm, silu_mul,
                              dtype_of(values), tuning, current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void macko_tensor_core_spmm(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr,
                            const at::Tensor& window_table, const at::Tensor& x, at::Tensor& out, at::Tensor& partials,
                            at::Tensor& counters, int64_t k_splits, int64_t steps, bool accumulate) {
    const char* op = "minfer.macko_tensor_core_spmm";
    check_macko(values, deltas, row_ptr, op);
    check_cuda_contiguous(window_table, "window_table");
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(out, "out");
    check_cuda_contiguous(partials, "partials");
    check_cuda_contiguous(counters, "counters");
    MINFER_CHECK(x.dim() == 2 && out.dim() == 2, op, ": expects x [T, K] and out [T, N]");
    const int64_t rows = row_ptr.numel() - 1, cols = x.size(1), tokens = x.size(0);
    MINFER_CHECK(tokens <= minfer::kMackoTensorCoreTokens, op, ": at most ", minfer::kMackoTensorCoreTokens,
                 " tokens per call, got ", tokens);
    MINFER_CHECK(out.size(0) == tokens && out.size(1) == rows, op, ": out must be [", tokens, ", ", rows, "]");
    MINFER_CHECK(cols <= minfer::kMackoTensorCoreMaxCols, op, ": at most ", minfer::kMackoTensorCoreMaxCols,
                 " columns (the window table's entry field), got ", cols);
    MINFER_CHECK(x.scalar_type() == values.scalar_type() && out.scalar_type() == values.scalar_type(), op,
                 ": values, x and out must share one dtype");
    const int64_t windows = std::max<int64_t>(1, (cols + minfer::kMackoWindowCols - 1) / minfer::kMackoWindowCols);
    const int64_t tiles = (rows + minfer::kMackoTileRows - 1) / minfer::kMackoTileRows;
    MINFER_CHECK(window_table.scalar_type() == at::kInt && window_table.dim() == 2 && window_table.size(0) == rows &&
                     window_table.size(1) == windows - 1,
                 op, ": window_table must be int32 [", rows, ", ", windows - 1, "] (ops.macko_window_table)");
    MINFER_CHECK(k_splits >= 1 && k_splits <= windows, op,
                 ": k_splits must be in [1, ", windows, "] (the column windows), got ", k_splits);
    MINFER_CHECK(steps == 0 || steps == 1 || steps == 2, op, ": steps must be 0 (auto), 1 or 2");
    MINFER_CHECK(counters.scalar_type() == at::kInt && counters.dim() == 1 && counters.numel() >= tiles, op,
                 ": counters must be int32 with at least ", tiles, " entries, zero");
    MINFER_CHECK(k_splits == 1 || (partials.scalar_type() == at::kFloat && partials.dim() == 3 &&
                                   reinterpret_cast<uintptr_t>(partials.data_ptr()) % 8 == 0 &&
                                   partials.size(0) == k_splits && partials.size(1) == minfer::kMackoTensorCoreTokens &&
                                   partials.size(2) == tiles * minfer::kMackoTileRows),
                 op, ": partials must be float32 [", k_splits, ", ", minfer::kMackoTensorCoreTokens, ", ",
                 tiles * minfer::kMackoTileRows, "]");
    for (const at::Tensor* t :
         std::initializer_list<const at::Tensor*>{&window_table, &x, &out, &partials, &counters})
        MINFER_CHECK(t->device() == values.device(), op, ": tensors on different devices");
    MINFER_CHECK(at::get_overlap_status(x, out) == at::MemOverlapStatus::No, op,
                 ": out must not overlap x (other blocks still read x while one writes out)");
    const c10::cuda::CUDAGuard guard(values.device());
    minfer::launch_macko_tensor_core_spmm(values.data_ptr(), deltas.data_ptr<uint8_t>(), row_ptr.data_ptr<int32_t>(),
                                          window_table.data_ptr<int32_t>(), x.data_ptr(), out.data_ptr(),
                                          k_splits > 1 ? partials.data_ptr<float>() : nullptr,
                                          counters.data_ptr<int32_t>(), rows, cols, tokens, (int)k_splits, (int)steps,
                                          accumulate,
                                          dtype_of(values), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void macko_decompress(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr, at::Tensor& out) {
    check_macko(values, deltas, row_ptr, "minfer.macko_decompress");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(out.dim() == 2 && out.size(0) == row_ptr.numel() - 1,
                "minfer.macko_decompress: out must be [rows, cols] with rows = row_ptr.numel() - 1");
    MINFER_CHECK(out.size(1) <= INT32_MAX, "minfer.macko_decompress: too many columns");
    MINFER_CHECK(out.scalar_type() == values.scalar_type(), "minfer.macko_decompress: out must have the values' dtype");
    MINFER_CHECK(out.device() == values.device(), "minfer.macko_decompress: tensors on different devices");
    const c10::cuda::CUDAGuard guard(values.device());
    minfer::launch_macko_decompress(values.data_ptr(), deltas.data_ptr<uint8_t>(), row_ptr.data_ptr<int32_t>(),
                                    out.data_ptr(), out.size(0), out.size(1), dtype_of(values), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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

// The same with the kernel pinned by name (kernels/hgemm.h), for tests and benchmarks.
void hgemm_kernel(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, c10::string_view kernel) {
    run_hgemm(x, w, out, std::string(kernel));
}

// ---- fused decode ops: rms_norm, add_rms_norm, rope_write_kv, decode_attention (kernels/rms_norm.h, rope.h,
// decode_attention.h) ----

void run_rms_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                  at::Tensor& out, const char* op) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(weight, "weight");
    check_cuda_contiguous(out, "out");
    const int64_t hidden = x.size(-1);
    MINFER_CHECK(weight.dim() == 1 && weight.size(0) == hidden, op, ": weight must be [", hidden, "]");
    MINFER_CHECK(out.sizes() == x.sizes(), op, ": out must have x's shape ", x.sizes());
    MINFER_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), op,
                ": x, weight and out must share one dtype");
    MINFER_CHECK(weight.device() == x.device() && out.device() == x.device(), op, ": tensors on different devices");
    if (residual != nullptr) {
        check_cuda_contiguous(*residual, "residual");
        MINFER_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                        residual->device() == x.device(),
                    op, ": residual must match x in shape, dtype and device");
    }
    if (x.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    const bool launched = minfer::launch_rms_norm(x.data_ptr(), residual ? residual->data_ptr() : nullptr,
                                                  weight.data_ptr(), out.data_ptr(), x.numel() / hidden, hidden,
                                                  (float)eps, dtype_of(x), current_stream());
    MINFER_CHECK(launched, op, ": rows of ", hidden, " elements are longer than the kernel holds (16384 fp16/bf16, ",
                "8192 fp32 or unaligned)");
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    run_rms_norm(x, nullptr, weight, eps, out, "minfer.rms_norm");
}

void add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    run_rms_norm(x, &residual, weight, eps, out, "minfer.add_rms_norm");
}

minfer::TokenHeadStrides token_head_strides(const at::Tensor& t, const char* name) {
    MINFER_CHECK(t.is_cuda() && t.dim() == 4 && t.stride(3) == 1, "minfer.rope_write_kv: ", name,
                " must be a CUDA [B, T, H, D] tensor with a contiguous last dim");
    return {t.stride(0), t.stride(1), t.stride(2)};
}

void rope_write_kv(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& input_pos, at::Tensor& k_cache, at::Tensor& v_cache) {
    const auto qs = token_head_strides(q, "q"), ks = token_head_strides(k, "k"), vs = token_head_strides(v, "v");
    check_cuda_contiguous(cos, "cos");
    check_cuda_contiguous(sin, "sin");
    check_cuda_contiguous(input_pos, "input_pos");
    check_cuda_contiguous(k_cache, "k_cache");
    check_cuda_contiguous(v_cache, "v_cache");
    const int64_t batch = q.size(0), tokens = q.size(1), q_heads = q.size(2), head_dim = q.size(3);
    const int64_t kv_heads = k.size(2);
    MINFER_CHECK(head_dim % 2 == 0, "minfer.rope_write_kv: head_dim must be even, got ", head_dim);
    MINFER_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(1) == tokens && k.size(3) == head_dim,
                "minfer.rope_write_kv: k and v must be [", batch, ", ", tokens, ", Hkv, ", head_dim, "]");
    MINFER_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == batch &&
                    k_cache.size(1) == kv_heads && k_cache.size(3) == head_dim,
                "minfer.rope_write_kv: caches must be [", batch, ", ", kv_heads, ", S, ", head_dim, "]");
    const int64_t max_seq_len = k_cache.size(2);
    MINFER_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                    cos.dim() == 2 && cos.size(1) == head_dim / 2 && cos.size(0) >= max_seq_len,
                "minfer.rope_write_kv: cos and sin must be float32 [>= ", max_seq_len, ", ", head_dim / 2, "]");
    MINFER_CHECK(input_pos.scalar_type() == at::kLong && input_pos.dim() == 1 && input_pos.size(0) == tokens,
                "minfer.rope_write_kv: input_pos must be int64 [", tokens, "]");
    const auto dtype = q.scalar_type();
    MINFER_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                    v_cache.scalar_type() == dtype,
                "minfer.rope_write_kv: q, k, v and the caches must share one dtype");
    const auto device = q.device();
    MINFER_CHECK(k.device() == device && v.device() == device && cos.device() == device && sin.device() == device &&
                    input_pos.device() == device && k_cache.device() == device && v_cache.device() == device,
                "minfer.rope_write_kv: tensors on different devices");
    const c10::cuda::CUDAGuard guard(device);
    minfer::launch_rope_write_kv(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr<float>(),
                                 sin.data_ptr<float>(), input_pos.data_ptr<int64_t>(), k_cache.data_ptr(),
                                 v_cache.data_ptr(), batch, tokens, q_heads, kv_heads, head_dim, max_seq_len, qs, ks,
                                 vs, dtype_of(q), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& input_pos, double scale, at::Tensor& out, at::Tensor& workspace,
                      int64_t num_splits, int64_t stages) {
    MINFER_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1,
                "minfer.decode_attention: q must be a CUDA [B, Hq, D] tensor with a contiguous last dim");
    check_cuda_contiguous(k_cache, "k_cache");
    check_cuda_contiguous(v_cache, "v_cache");
    check_cuda_contiguous(input_pos, "input_pos");
    check_cuda_contiguous(out, "out");
    check_cuda_contiguous(workspace, "workspace");
    const int64_t batch = q.size(0), q_heads = q.size(1), head_dim = q.size(2);
    MINFER_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == batch &&
                    k_cache.size(3) == head_dim,
                "minfer.decode_attention: caches must be [", batch, ", Hkv, S, ", head_dim, "]");
    const int64_t kv_heads = k_cache.size(1), max_seq_len = k_cache.size(2);
    MINFER_CHECK(head_dim == 64 || head_dim == 128, "minfer.decode_attention: head_dim 64 or 128, got ", head_dim);
    MINFER_CHECK(kv_heads >= 1 && q_heads % kv_heads == 0 && q_heads / kv_heads <= minfer::kDecodeAttnMaxGroup,
                "minfer.decode_attention: Hq must be a multiple of Hkv, at most ", minfer::kDecodeAttnMaxGroup,
                " times it; got Hq=", q_heads, ", Hkv=", kv_heads);
    MINFER_CHECK(max_seq_len >= 1, "minfer.decode_attention: empty cache");
    const auto dtype = q.scalar_type();
    MINFER_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
                "minfer.decode_attention: float16 or bfloat16 only, got ", dtype);
    MINFER_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
                "minfer.decode_attention: q, caches and out must share one dtype");
    MINFER_CHECK(reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % 16 == 0,
                "minfer.decode_attention: caches must be 16-byte aligned");
    MINFER_CHECK(input_pos.scalar_type() == at::kLong && input_pos.numel() == 1,
                "minfer.decode_attention: input_pos must be int64 with one element");
    MINFER_CHECK(out.sizes() == q.sizes(), "minfer.decode_attention: out must be [", batch, ", ", q_heads, ", ",
                head_dim, "]");
    MINFER_CHECK(num_splits >= 1 && num_splits <= minfer::kDecodeAttnMaxSplits,
                "minfer.decode_attention: num_splits must be in 1..", minfer::kDecodeAttnMaxSplits);
    const int64_t need = minfer::decode_attention_workspace_floats(batch, q_heads, kv_heads, head_dim, num_splits);
    MINFER_CHECK(workspace.scalar_type() == at::kFloat && workspace.numel() >= need &&
                    reinterpret_cast<uintptr_t>(workspace.data_ptr()) % 16 == 0,
                "minfer.decode_attention: workspace must be zero-initialised float32 of >= ", need,
                " elements (minfer.ops.decode_attention_workspace makes one)");
    const auto device = q.device();
    MINFER_CHECK(k_cache.device() == device && v_cache.device() == device && input_pos.device() == device &&
                    out.device() == device && workspace.device() == device,
                "minfer.decode_attention: tensors on different devices");
    const c10::cuda::CUDAGuard guard(device);
    minfer::launch_decode_attention(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                                    input_pos.data_ptr<int64_t>(), (float)scale, out.data_ptr(),
                                    workspace.data_ptr<float>(), batch, q_heads, kv_heads, head_dim, max_seq_len,
                                    (int)num_splits, (int)stages, dtype_of(q), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY(minfer, m) {
    m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
    m.def("gemv(Tensor x, Tensor w, Tensor(a!) out, Tensor? norm_weight=None, float eps=0.0, bool accumulate=False, "
          "int warps_per_block=0, int unroll=0, bool silu_mul=False) -> ()");
    m.def("hgemm(Tensor x, Tensor w, Tensor(a!) out) -> ()");
    m.def("hgemm_kernel(Tensor x, Tensor w, Tensor(a!) out, str kernel) -> ()");
    m.def("embedding(Tensor table, Tensor tokens, Tensor(a!) out) -> ()");
    m.def("argmax(Tensor logits, Tensor(a!) out, Tensor(b!)? position=None, Tensor(c!)? host_tokens=None) -> ()");
    m.def("macko_spmv(Tensor values, Tensor deltas, Tensor row_ptr, Tensor x, Tensor(a!) out, Tensor? norm_weight, float eps, int steps, int warps_per_block, int x_in_smem, int pipeline, bool accumulate, bool silu_mul) -> ()");
    m.def("macko_tensor_core_spmm(Tensor values, Tensor deltas, Tensor row_ptr, Tensor window_table, Tensor x, Tensor(a!) out, Tensor(b!) partials, Tensor(c!) counters, int k_splits, int steps, bool accumulate) -> ()");
    m.def("macko_decompress(Tensor values, Tensor deltas, Tensor row_ptr, Tensor(a!) out) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
    m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps, Tensor(b!) out) -> ()");
    m.def("rope_write_kv(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor input_pos, Tensor(b!) k_cache, Tensor(c!) v_cache) -> ()");
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, float scale, Tensor(a!) out, Tensor(b!) workspace, int num_splits, int stages=0) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("silu_mul", &silu_mul);
    m.impl("gemv", &gemv);
    m.impl("hgemm", &hgemm);
    m.impl("hgemm_kernel", &hgemm_kernel);
    m.impl("embedding", &embedding);
    m.impl("argmax", &argmax);
    m.impl("macko_spmv", &macko_spmv);
    m.impl("macko_tensor_core_spmm", &macko_tensor_core_spmm);
    m.impl("macko_decompress", &macko_decompress);
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("rope_write_kv", &rope_write_kv);
    m.impl("decode_attention", &decode_attention);
}
