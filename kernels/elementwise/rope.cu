#include "rope.h"
#include "common/device_utils.cuh"

namespace minfer {

namespace {

constexpr int kThreads = 256;

struct RopeShape {
    int64_t tokens, q_heads, kv_heads, half_dim, max_seq_len;
};

// One thread per (head, i < D/2) pair of one token: q heads first, then k heads, then v heads.
// Each pair is read once and written once, so the kernel is a single pass over q, k and v.
template <typename T>
__global__ void rope_write_kv_kernel(T* q, const T* k, const T* v, const float* __restrict__ cos,
                                     const float* __restrict__ sin, const int64_t* input_pos, T* __restrict__ k_cache,
                                     T* __restrict__ v_cache, RopeShape shape, TokenHeadStrides qs,
                                     TokenHeadStrides ks, TokenHeadStrides vs) {
    allow_dependents_to_launch();
    const int64_t b = blockIdx.x / shape.tokens, t = blockIdx.x % shape.tokens;
    const int64_t item = blockIdx.y * (int64_t)kThreads + threadIdx.x;
    const int64_t heads = shape.q_heads + 2 * shape.kv_heads;
    // input_pos and the tables are read before the PDL wait (rope.h: input_pos may not come from the
    // kernel right before), so only q, k and v cost a round trip after it. Every thread waits, also
    // those with nothing to do: this kernel must not complete before the one ahead of it.
    const int64_t head = item / shape.half_dim, i = item % shape.half_dim;
    const int64_t pos = item < heads * shape.half_dim ? input_pos[t] : -1;
    const bool active = pos >= 0 && pos < shape.max_seq_len;
    const bool is_v = head >= shape.q_heads + shape.kv_heads;
    const float c = active && !is_v ? cos[pos * shape.half_dim + i] : 0.0f;
    const float s = active && !is_v ? sin[pos * shape.half_dim + i] : 0.0f;
    wait_for_previous_kernel();  // q, k, v come from the previous kernel: plain (not .nc) loads below
    if (!active) return;
    const int64_t head_dim = 2 * shape.half_dim;

    if (is_v) {  // v: a plain copy into the cache
        const int64_t h = head - shape.q_heads - shape.kv_heads;
        const T* src = v + b * vs.batch + t * vs.token + h * vs.head;
        T* dst = v_cache + ((b * shape.kv_heads + h) * shape.max_seq_len + pos) * head_dim;
        dst[i] = src[i];
        dst[i + shape.half_dim] = src[i + shape.half_dim];
        return;
    }
    const bool is_q = head < shape.q_heads;
    const int64_t h = is_q ? head : head - shape.q_heads;
    const T* src = is_q ? q + b * qs.batch + t * qs.token + h * qs.head : k + b * ks.batch + t * ks.token + h * ks.head;
    const float x1 = to_float(src[i]), x2 = to_float(src[i + shape.half_dim]);
    T* dst = is_q ? q + b * qs.batch + t * qs.token + h * qs.head
                  : k_cache + ((b * shape.kv_heads + h) * shape.max_seq_len + pos) * head_dim;
    dst[i] = from_float<T>(x1 * c - x2 * s);
    dst[i + shape.half_dim] = from_float<T>(x2 * c + x1 * s);
}

template <typename T>
void launch_typed(void* q, const void* k, const void* v, const float* cos, const float* sin, const int64_t* input_pos,
                  void* k_cache, void* v_cache, int64_t batch, RopeShape shape, TokenHeadStrides qs,
                  TokenHeadStrides ks, TokenHeadStrides vs, cudaStream_t stream) {
    const int64_t items = (shape.q_heads + 2 * shape.kv_heads) * shape.half_dim;
    const dim3 grid((unsigned)(batch * shape.tokens), (unsigned)((items + kThreads - 1) / kThreads));
    launch_with_pdl(rope_write_kv_kernel<T>, grid, dim3(kThreads), 0, stream, true, static_cast<T*>(q),
                    static_cast<const T*>(k), static_cast<const T*>(v), cos, sin, input_pos, static_cast<T*>(k_cache),
                    static_cast<T*>(v_cache), shape, qs, ks, vs);
}

}  // namespace

void launch_rope_write_kv(void* q, const void* k, const void* v, const float* cos, const float* sin,
                          const int64_t* input_pos, void* k_cache, void* v_cache, int64_t batch, int64_t tokens,
                          int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t max_seq_len,
                          TokenHeadStrides q_strides, TokenHeadStrides k_strides, TokenHeadStrides v_strides,
                          DType dtype, cudaStream_t stream) {
    if (batch * tokens == 0) return;
    const RopeShape shape{tokens, q_heads, kv_heads, head_dim / 2, max_seq_len};
    switch (dtype) {
        case DType::kFloat16:
            launch_typed<half>(q, k, v, cos, sin, input_pos, k_cache, v_cache, batch, shape, q_strides, k_strides,
                               v_strides, stream);
            break;
        case DType::kBFloat16:
            launch_typed<__nv_bfloat16>(q, k, v, cos, sin, input_pos, k_cache, v_cache, batch, shape, q_strides,
                                        k_strides, v_strides, stream);
            break;
        case DType::kFloat32:
            launch_typed<float>(q, k, v, cos, sin, input_pos, k_cache, v_cache, batch, shape, q_strides, k_strides,
                                v_strides, stream);
            break;
    }
}

}  // namespace minfer
