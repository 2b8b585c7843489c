// The torch.ops.minfer namespace. Every kernel family adds its ops to it from its own
// <family>_ops.cpp with TORCH_LIBRARY_FRAGMENT(minfer, m) (the build compiles kernels/*/*.cpp and *.cu).
#include <torch/library.h>

TORCH_LIBRARY(minfer, m) {}
