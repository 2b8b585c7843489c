// The KS factor kernels (ksmm.h), one file per kernel so that they compile in parallel: ksmm_rows.cu,
// ksmm_gemv.cu, ksmm_mma.cu; ksmm.cu holds the generic kernel and picks one. Each launcher takes x [tokens][a*c*d],
// the factor W [a][b][c][d] and y [tokens][a*b*d] (contiguous) and a shape its kernel supports (ksmm_path_supports).
#pragma once
#include "common/device_utils.cuh"

namespace minfer::ksmm_detail {

constexpr int kThreads = 256;

int sm_count();

template <typename T>
void launch_rows(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 bool accumulate, cudaStream_t stream);
// gemv also runs the decode fusions (ksmm_gemv_fusion_supports says which shapes take which).
template <typename T>
void launch_gemv(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                 const ProjectionFusion& fusion, cudaStream_t stream);
template <typename T>
void launch_mma(const T* x, const T* w, T* y, int64_t tokens, int64_t a, int64_t b, int64_t c, int64_t d,
                cudaStream_t stream);

}  // namespace minfer::ksmm_detail
