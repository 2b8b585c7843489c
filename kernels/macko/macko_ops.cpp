// MACKO-16-4 sparse matrices (macko.h): the SpMV/SpMM, the tensor-core SpMM and decompression.
// Each binding checks the tensors and forwards raw pointers to the framework-free launchers.
#include "common/torch_binding.h"
#include "macko/macko.h"

namespace {

using namespace minfer::binding;

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

// The launch knobs pinned (MackoTuning, macko.h), for sweeps and their tests.
void macko_spmv_tuned(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr,
                      const at::Tensor& x, at::Tensor& out, const std::optional<at::Tensor>& norm_weight, double eps,
                      bool accumulate, bool silu_mul, int64_t steps, int64_t warps_per_block, int64_t x_in_smem,
                      int64_t pipeline) {
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

void macko_spmv(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr, const at::Tensor& x,
                at::Tensor& out, const std::optional<at::Tensor>& norm_weight, double eps, bool accumulate,
                bool silu_mul) {
    macko_spmv_tuned(values, deltas, row_ptr, x, out, norm_weight, eps, accumulate, silu_mul, 0, 0, -1, 1);
}

// The warp steps per load group pinned (`steps`, macko.h), for sweeps and their tests.
void macko_tensor_core_spmm_tuned(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr,
                                  const at::Tensor& window_table, const at::Tensor& x, at::Tensor& out,
                                  at::Tensor& partials, at::Tensor& counters, int64_t k_splits, bool accumulate,
                                  int64_t steps) {
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

void macko_tensor_core_spmm(const at::Tensor& values, const at::Tensor& deltas, const at::Tensor& row_ptr,
                            const at::Tensor& window_table, const at::Tensor& x, at::Tensor& out, at::Tensor& partials,
                            at::Tensor& counters, int64_t k_splits, bool accumulate) {
    macko_tensor_core_spmm_tuned(values, deltas, row_ptr, window_table, x, out, partials, counters, k_splits,
                                 accumulate, 0);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    // No defaults in these schemas: a defaulted argument segfaulted another op on the device.
    m.def("macko_spmv(Tensor values, Tensor deltas, Tensor row_ptr, Tensor x, Tensor(a!) out, Tensor? norm_weight, "
          "float eps, bool accumulate, bool silu_mul) -> ()");
    m.def("macko_spmv_tuned(Tensor values, Tensor deltas, Tensor row_ptr, Tensor x, Tensor(a!) out, "
          "Tensor? norm_weight, float eps, bool accumulate, bool silu_mul, int steps, int warps_per_block, "
          "int x_in_smem, int pipeline) -> ()");
    m.def("macko_tensor_core_spmm(Tensor values, Tensor deltas, Tensor row_ptr, Tensor window_table, Tensor x, "
          "Tensor(a!) out, Tensor(b!) partials, Tensor(c!) counters, int k_splits, bool accumulate) -> ()");
    m.def("macko_tensor_core_spmm_tuned(Tensor values, Tensor deltas, Tensor row_ptr, Tensor window_table, "
          "Tensor x, Tensor(a!) out, Tensor(b!) partials, Tensor(c!) counters, int k_splits, bool accumulate, "
          "int steps) -> ()");
    m.def("macko_decompress(Tensor values, Tensor deltas, Tensor row_ptr, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("macko_spmv", &macko_spmv);
    m.impl("macko_spmv_tuned", &macko_spmv_tuned);
    m.impl("macko_tensor_core_spmm", &macko_tensor_core_spmm);
    m.impl("macko_tensor_core_spmm_tuned", &macko_tensor_core_spmm_tuned);
    m.impl("macko_decompress", &macko_decompress);
}
