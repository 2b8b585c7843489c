// Greedy decoding: out[b] = index of the largest logits[b, :] (first one on ties, NaN counts as largest,
// as torch.argmax does).
#pragma once
#include "launch.h"

namespace minfer {

void launch_argmax(const void* logits, int64_t* out, int64_t rows, int64_t vocab, DType dtype, cudaStream_t stream);

}  // namespace minfer
