// KS factor products (ksmm.h): the generic kernel (one thread per output, any pattern and alignment: odd d
// or c*d, the contract's samples) and the choice between it and the fast kernels of ksmm_kernels.cuh.
#include <algorithm>

#include "ksmm/ksmm.h"
#include "ksmm/ksmm_kernels.cuh"

namespace minfer {

namespace ksmm_detail {

int sm_count() {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return std::max(sms, 1);
}

}  // namespace ksmm_detail

namespace {

using namespace ksmm_detail;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

template <typename T>
__global__ void __launch_bounds__(kThreads) ksmm_generic_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                               T* __restrict__ y, int64_t total, int a, int b,
                                                               int c, int d) {
    for (int64_t o = (int64_t)blockIdx.x * kThreads + threadIdx.x; o < total; o += (int64_t)gridDim.x * kThreads) {
        const int l = (int)(o % d);
        int64_t rest = o / d;
        const int j = (int)(rest % b);
        rest /= b;
        const int i = (int)(rest % a);
        const int64_t n = rest / a;
        const T* x_at = x + (n * a + i) * c * d + l;
        const T* w_at = w + ((int64_t)i * b + j) * c * d + l;
        float sum = 0.f;
        for (int k = 0; k < c; ++k) sum = fmaf(to_float(x_at[(int64_t)k * d]), to_float(w_at[(int64_t)k * d]), sum);
        y[o] = from_float<T>(sum);
    }
}

template <typename T>
void launch_typed(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                  KsmmPath path, cudaStream_t stream) {
    switch (path) {
        case KsmmPath::kRows: return launch_rows<T>(x, w, y, tokens, a, b, c, d, false, stream);
        case KsmmPath::kGemv: return launch_gemv<T>(x, w, y, tokens, a, b, c, d, ProjectionFusion{}, stream);
        case KsmmPath::kTensorCore: return launch_mma<T>(x, w, y, tokens, a, b, c, d, stream);
        default: {
            const int64_t total = tokens * a * b * d;
            const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65536);
            ksmm_generic_kernel<T><<<(unsigned)blocks, kThreads, 0, stream>>>(x, w, y, total, (int)a, (int)b, (int)c,
                                                                               (int)d);
        }
    }
}

}  // namespace

bool ksmm_path_supports(KsmmPath path, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x,
                        const void* w, const void* y) {
    const bool vectors = (c * d) % 8 == 0 && aligned16(x) && aligned16(w);
    switch (path) {
        case KsmmPath::kAuto:
        case KsmmPath::kGeneric: return true;
        case KsmmPath::kRows:
            return tokens <= kKsmmRowsMaxTokens && power_of_two(d) && d <= kKsmmRowsMaxD && vectors;
        case KsmmPath::kGemv:
            return tokens <= kKsmmRowsMaxTokens && (d == 1 || d == 2 || d == 4 || d % 8 == 0) && vectors;
        case KsmmPath::kWgmma: return d == 1 && ksmm_wgmma_supports(tokens, a, b, c, x, w, y);
        case KsmmPath::kTensorCore:
            // y too: its epilogue stores an output's l's at once (up to 16 bytes)
            return (d == 1 || d == 2 || d == 4 || d % 8 == 0) && vectors && aligned16(y) &&
                   a * (d < 8 ? 1 : d / 8) <= 65535;
    }
    return false;
}

KsmmPath ksmm_auto_path(int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x, const void* w,
                        const void* y) {
    if (tokens == 1 && ksmm_path_supports(KsmmPath::kRows, tokens, a, b, c, d, x, w, y)) return KsmmPath::kRows;
    if (ksmm_path_supports(KsmmPath::kGemv, tokens, a, b, c, d, x, w, y)) return KsmmPath::kGemv;
    if (ksmm_path_supports(KsmmPath::kTensorCore, tokens, a, b, c, d, x, w, y)) return KsmmPath::kTensorCore;
    return KsmmPath::kGeneric;
}

void launch_ksmm(const void* x, const void* w, void* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 KsmmPath path, DType dtype, cudaStream_t stream) {
    if (tokens == 0 || a * b * d == 0) return;
    if (c == 0) {
        cudaMemsetAsync(y, 0, tokens * a * b * d * 2, stream);
        return;
    }
    if (path == KsmmPath::kAuto) path = ksmm_auto_path(tokens, a, b, c, d, x, w, y);
    if (path == KsmmPath::kWgmma) {
        // A map the driver refuses after all falls back to the ring tiles (or generic): never no output.
        if (launch_ksmm_wgmma(x, w, y, tokens, a, b, c, 1, 1, 1, 0, dtype, stream) == nullptr) return;
        path = ksmm_path_supports(KsmmPath::kTensorCore, tokens, a, b, c, d, x, w, y) ? KsmmPath::kTensorCore
                                                                                        : KsmmPath::kGeneric;
    }
    if (dtype == DType::kBFloat16)
        launch_typed(static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w),
                     static_cast<__nv_bfloat16*>(y), tokens, a, b, c, d, path, stream);
    else
        launch_typed(static_cast<const half*>(x), static_cast<const half*>(w), static_cast<half*>(y), tokens, a, b,
                     c, d, path, stream);
}

bool ksmm_gemv_fusion_supports(int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d, const void* x, const void* w,
                               const void* y, const ProjectionFusion& fusion) {
    if (!ksmm_path_supports(KsmmPath::kGemv, tokens, a, b, c, d, x, w, y) || tokens < 1 || c < 1) return false;
    if (fusion.norm_weight && !aligned16(fusion.norm_weight)) return false;
    return !fusion.silu_mul || (a == 1 && b % 2 == 0 && !fusion.accumulate);
}

void launch_ksmm_gemv(const void* x, const void* w, void* y, int64_t tokens, int64_t a, int64_t b, int64_t c,
                      int64_t d, const ProjectionFusion& fusion, DType dtype, cudaStream_t stream) {
    if (a * b * d == 0) return;
    // One token with at most the residual add: the rows kernel, faster than gemv there (ksmm_auto_path).
    const bool rows = tokens == 1 && !fusion.norm_weight && !fusion.silu_mul &&
                      ksmm_path_supports(KsmmPath::kRows, tokens, a, b, c, d, x, w, y);
    if (dtype == DType::kBFloat16) {
        const auto *xt = static_cast<const __nv_bfloat16*>(x), *wt = static_cast<const __nv_bfloat16*>(w);
        auto* yt = static_cast<__nv_bfloat16*>(y);
        if (rows) return ksmm_detail::launch_rows(xt, wt, yt, tokens, a, b, c, d, fusion.accumulate, stream);
        return ksmm_detail::launch_gemv(xt, wt, yt, tokens, a, b, c, d, fusion, stream);
    }
    const auto *xt = static_cast<const half*>(x), *wt = static_cast<const half*>(w);
    auto* yt = static_cast<half*>(y);
    if (rows) return ksmm_detail::launch_rows(xt, wt, yt, tokens, a, b, c, d, fusion.accumulate, stream);
    ksmm_detail::launch_gemv(xt, wt, yt, tokens, a, b, c, d, fusion, stream);
}

}  // namespace minfer
