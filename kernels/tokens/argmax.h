// Greedy decoding: out[b] = index of the largest logits[b, :] (first one on ties, NaN counts as largest,
// as torch.argmax does).
#pragma once
#include "common/launch.h"

namespace minfer {

// Where a decode step hands its token to the host: with `position` (device) and `host_tokens`
// (page-locked host memory, which the GPU writes directly under unified addressing), one row:
// host_tokens[*position + 1] = the token (skipped past `capacity` entries), then *position += 1. The
// generation loop then reads tokens from host memory with no copy in the stream between graph
// replays. Null pointers: no hand-off.
struct TokenHandoff {
    int64_t* position = nullptr;
    int64_t* host_tokens = nullptr;
    int64_t capacity = 0;
};

void launch_argmax(const void* logits, int64_t* out, int64_t rows, int64_t vocab, DType dtype,
                   const TokenHandoff& handoff, cudaStream_t stream);

}  // namespace minfer
