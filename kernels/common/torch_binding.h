// What the op bindings of every kernel family share: MINFER_CHECK (error text torch can raise safely),
// dtype and layout checks, and the current stream. Torch-side only; the kernels stay framework-free.
#pragma once
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "common/launch.h"

namespace minfer::binding {

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
inline CheckMessage check_message(const Args&... args) {
    CheckMessage message;
    (message.add(args), ...);
    return message;
}

#define MINFER_CHECK(cond, ...)                                                                         \
    do {                                                                                                \
        if (!(cond)) {                                                                                  \
            const ::minfer::binding::CheckMessage minfer_check_message_ =                               \
                ::minfer::binding::check_message(__VA_ARGS__);                                          \
            TORCH_CHECK(false, static_cast<const char*>(minfer_check_message_.text));                   \
        }                                                                                               \
    } while (0)

// `what` names the argument in the error, e.g. "minfer.embedding: table".
inline DType dtype_of(const at::Tensor& t, const char* what = "minfer") {
    switch (t.scalar_type()) {
        case at::kHalf: return DType::kFloat16;
        case at::kBFloat16: return DType::kBFloat16;
        case at::kFloat: return DType::kFloat32;
        default: MINFER_CHECK(false, what, ": unsupported dtype ", t.scalar_type(), " (float16, bfloat16, float32)");
    }
}

inline void check_cuda_contiguous(const at::Tensor& t, const char* name) {
    MINFER_CHECK(t.is_cuda(), "minfer: ", name, " must be a CUDA tensor");
    MINFER_CHECK(t.is_contiguous(), "minfer: ", name, " must be contiguous");
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

// The fusions of a decode projection (launch.h) from the optional norm weight and the accumulate flag.
inline ProjectionFusion projection_fusion(const std::optional<at::Tensor>& norm_weight, double eps, bool accumulate,
                                          const at::Tensor& x, const at::Tensor& out, int64_t k, const char* op) {
    ProjectionFusion fusion;
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

}  // namespace minfer::binding
