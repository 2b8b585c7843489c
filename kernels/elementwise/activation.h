// SiLU-and-mul for the Llama MLP: out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i].
#pragma once
#include "common/launch.h"

namespace minfer {

void launch_silu_mul(const void* gate_up, void* out, int64_t tokens, int64_t inter, DType dtype,
                     cudaStream_t stream);

}  // namespace minfer
