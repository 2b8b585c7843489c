// Token embedding lookup (embedding.h): one block per token copies its row, 16 bytes per thread and
// step when the row and both addresses allow it, else 2 bytes (every dtype here is 2 or 4 bytes).
#include "embedding.h"

namespace minfer {

namespace {

constexpr int kThreads = 128;

template <typename Unit>
__global__ void __launch_bounds__(kThreads) embedding_kernel(const unsigned char* __restrict__ table,
                                                             const int64_t* __restrict__ tokens,
                                                             unsigned char* __restrict__ out, int64_t vocab,
                                                             int64_t row_bytes) {
    const int64_t token = tokens[blockIdx.x];
    if (token < 0 || token >= vocab) __trap();
    const Unit* src = reinterpret_cast<const Unit*>(table + token * row_bytes);
    Unit* dst = reinterpret_cast<Unit*>(out + (int64_t)blockIdx.x * row_bytes);
    const int64_t units = row_bytes / (int64_t)sizeof(Unit);
    for (int64_t i = threadIdx.x; i < units; i += kThreads) dst[i] = src[i];
}

}  // namespace

void launch_embedding(const void* table, const int64_t* tokens, void* out, int64_t count, int64_t vocab,
                      int64_t row_bytes, cudaStream_t stream) {
    if (count == 0 || row_bytes == 0) return;
    const auto* src = static_cast<const unsigned char*>(table);
    auto* dst = static_cast<unsigned char*>(out);
    const bool vectors = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(table) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(out) % 16 == 0;
    if (vectors)
        embedding_kernel<uint4><<<(unsigned)count, kThreads, 0, stream>>>(src, tokens, dst, vocab, row_bytes);
    else
        embedding_kernel<uint16_t><<<(unsigned)count, kThreads, 0, stream>>>(src, tokens, dst, vocab, row_bytes);
}

}  // namespace minfer
