// Token embedding lookup, out[i, :] = table[tokens[i], :], reading the table where it lives: device
// memory, or page-locked host memory, which the GPU reads directly under unified addressing. A
// table in host memory costs no GPU memory; a decode step then reads one row over PCIe.
#pragma once
#include "common/launch.h"

namespace minfer {

// A token outside [0, vocab) traps (a device-side error, as torch.nn.functional.embedding asserts).
void launch_embedding(const void* table, const int64_t* tokens, void* out, int64_t count, int64_t vocab,
                      int64_t row_bytes, cudaStream_t stream);

}  // namespace minfer
