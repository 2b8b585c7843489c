// Tokens in and out: the embedding lookup (embedding.h) and greedy argmax with the token hand-off (argmax.h).
// Each binding checks the tensors and forwards raw pointers to the framework-free launchers.
#include "common/torch_binding.h"
#include "tokens/argmax.h"
#include "tokens/embedding.h"

namespace {

using namespace minfer::binding;

void embedding(const at::Tensor& table, const at::Tensor& tokens, at::Tensor& out) {
    check_cuda_contiguous(tokens, "tokens");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(table.dim() == 2 && table.is_contiguous(), "minfer.embedding: table must be a contiguous [V, D] matrix");
    MINFER_CHECK((table.is_cuda() && table.device() == tokens.device()) || (table.is_cpu() && table.is_pinned()),
                 "minfer.embedding: table must be on the tokens' GPU or in pinned host memory");
    dtype_of(table, "minfer.embedding: table");  // refuses anything but float16, bfloat16 and float32
    MINFER_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "minfer.embedding: tokens must be 1-D int64");
    MINFER_CHECK(out.dim() == 2 && out.size(0) == tokens.size(0) && out.size(1) == table.size(1),
                 "minfer.embedding: out must be [tokens, D]");
    MINFER_CHECK(out.scalar_type() == table.scalar_type(), "minfer.embedding: out must have the table's dtype");
    MINFER_CHECK(out.device() == tokens.device(), "minfer.embedding: out must be on the tokens' device");
    MINFER_CHECK(tokens.size(0) <= INT32_MAX, "minfer.embedding: too many tokens");
    const c10::cuda::CUDAGuard guard(tokens.device());
    minfer::launch_embedding(table.data_ptr(), tokens.data_ptr<int64_t>(), out.data_ptr(), tokens.size(0),
                             table.size(0), table.size(1) * (int64_t)table.element_size(), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void argmax(const at::Tensor& logits, at::Tensor& out, const std::optional<at::Tensor>& position,
            const std::optional<at::Tensor>& host_tokens) {
    check_cuda_contiguous(logits, "logits");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(logits.dim() == 2, "minfer.argmax: expects logits [B, V]");
    MINFER_CHECK(out.dim() == 1 && out.size(0) == logits.size(0), "minfer.argmax: out must be [B]");
    MINFER_CHECK(out.scalar_type() == at::kLong, "minfer.argmax: out must be int64");
    MINFER_CHECK(logits.size(1) >= 1 && logits.size(1) <= INT32_MAX, "minfer.argmax: V must be in 1..2^31-1");
    MINFER_CHECK(logits.device() == out.device(), "minfer.argmax: tensors on different devices");
    MINFER_CHECK(position.has_value() == host_tokens.has_value(),
                 "minfer.argmax: position and host_tokens go together (the token hand-off)");
    minfer::TokenHandoff handoff;
    if (position.has_value()) {
        check_cuda_contiguous(*position, "position");
        MINFER_CHECK(position->numel() == 1 && position->scalar_type() == at::kLong && position->device() == out.device(),
                     "minfer.argmax: position must be one int64 on the logits' device");
        MINFER_CHECK(host_tokens->device().is_cpu() && host_tokens->is_pinned() && host_tokens->dim() == 1 &&
                         host_tokens->is_contiguous() && host_tokens->scalar_type() == at::kLong,
                     "minfer.argmax: host_tokens must be a contiguous 1-D int64 tensor in pinned host memory");
        MINFER_CHECK(logits.size(0) == 1, "minfer.argmax: the token hand-off takes one row of logits");
        handoff.position = position->data_ptr<int64_t>();
        handoff.host_tokens = host_tokens->data_ptr<int64_t>();
        handoff.capacity = host_tokens->numel();
    }
    if (logits.size(0) == 0) return;
    const c10::cuda::CUDAGuard guard(logits.device());
    minfer::launch_argmax(logits.data_ptr(), out.data_ptr<int64_t>(), logits.size(0), logits.size(1),
                          dtype_of(logits), handoff, current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("embedding(Tensor table, Tensor tokens, Tensor(a!) out) -> ()");
    m.def("argmax(Tensor logits, Tensor(a!) out, Tensor(b!)? position=None, Tensor(c!)? host_tokens=None) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("embedding", &embedding);
    m.impl("argmax", &argmax);
}
