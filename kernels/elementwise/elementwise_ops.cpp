// Per-token element-wise ops: SiLU-and-mul (activation.h), RMSNorm with the fused residual add (rms_norm.h),
// RoPE fused with the KV-cache write (rope.h).
// Each binding checks the tensors and forwards raw pointers to the framework-free launchers.
#include "common/torch_binding.h"
#include "elementwise/activation.h"
#include "elementwise/rms_norm.h"
#include "elementwise/rope.h"

namespace {

using namespace minfer::binding;

void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
    check_cuda_contiguous(gate_up, "gate_up");
    check_cuda_contiguous(out, "out");
    MINFER_CHECK(gate_up.scalar_type() == out.scalar_type(), "minfer.silu_mul: dtype mismatch");
    const int64_t inter = out.size(-1);
    MINFER_CHECK(gate_up.size(-1) == 2 * inter, "minfer.silu_mul: gate_up last dim must be 2x out's");
    MINFER_CHECK(gate_up.numel() == 2 * out.numel(), "minfer.silu_mul: leading dims differ");
    const c10::cuda::CUDAGuard guard(gate_up.device());
    minfer::launch_silu_mul(gate_up.data_ptr(), out.data_ptr(), out.numel() / inter, inter, dtype_of(out),
                            current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_rms_norm(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                  at::Tensor& out, const char* op) {
    check_cuda_contiguous(x, "x");
    check_cuda_contiguous(weight, "weight");
    check_cuda_contiguous(out, "out");
    const int64_t hidden = x.size(-1);
    MINFER_CHECK(weight.dim() == 1 && weight.size(0) == hidden, op, ": weight must be [", hidden, "]");
    MINFER_CHECK(out.sizes() == x.sizes(), op, ": out must have x's shape ", x.sizes());
    MINFER_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(), op,
                ": x, weight and out must share one dtype");
    MINFER_CHECK(weight.device() == x.device() && out.device() == x.device(), op, ": tensors on different devices");
    if (residual != nullptr) {
        check_cuda_contiguous(*residual, "residual");
        MINFER_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                        residual->device() == x.device(),
                    op, ": residual must match x in shape, dtype and device");
    }
    if (x.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    const bool launched = minfer::launch_rms_norm(x.data_ptr(), residual ? residual->data_ptr() : nullptr,
                                                  weight.data_ptr(), out.data_ptr(), x.numel() / hidden, hidden,
                                                  (float)eps, dtype_of(x), current_stream());
    MINFER_CHECK(launched, op, ": rows of ", hidden, " elements are longer than the kernel holds (16384 fp16/bf16, ",
                "8192 fp32 or unaligned)");
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    run_rms_norm(x, nullptr, weight, eps, out, "minfer.rms_norm");
}

void add_rms_norm(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
    run_rms_norm(x, &residual, weight, eps, out, "minfer.add_rms_norm");
}

minfer::TokenHeadStrides token_head_strides(const at::Tensor& t, const char* name) {
    MINFER_CHECK(t.is_cuda() && t.dim() == 4 && t.stride(3) == 1, "minfer.rope_write_kv: ", name,
                " must be a CUDA [B, T, H, D] tensor with a contiguous last dim");
    return {t.stride(0), t.stride(1), t.stride(2)};
}

void rope_write_kv(at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& input_pos, at::Tensor& k_cache, at::Tensor& v_cache) {
    const auto qs = token_head_strides(q, "q"), ks = token_head_strides(k, "k"), vs = token_head_strides(v, "v");
    check_cuda_contiguous(cos, "cos");
    check_cuda_contiguous(sin, "sin");
    check_cuda_contiguous(input_pos, "input_pos");
    check_cuda_contiguous(k_cache, "k_cache");
    check_cuda_contiguous(v_cache, "v_cache");
    const int64_t batch = q.size(0), tokens = q.size(1), q_heads = q.size(2), head_dim = q.size(3);
    const int64_t kv_heads = k.size(2);
    MINFER_CHECK(head_dim % 2 == 0, "minfer.rope_write_kv: head_dim must be even, got ", head_dim);
    MINFER_CHECK(k.sizes() == v.sizes() && k.size(0) == batch && k.size(1) == tokens && k.size(3) == head_dim,
                "minfer.rope_write_kv: k and v must be [", batch, ", ", tokens, ", Hkv, ", head_dim, "]");
    MINFER_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == batch &&
                    k_cache.size(1) == kv_heads && k_cache.size(3) == head_dim,
                "minfer.rope_write_kv: caches must be [", batch, ", ", kv_heads, ", S, ", head_dim, "]");
    const int64_t max_seq_len = k_cache.size(2);
    MINFER_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
                    cos.dim() == 2 && cos.size(1) == head_dim / 2 && cos.size(0) >= max_seq_len,
                "minfer.rope_write_kv: cos and sin must be float32 [>= ", max_seq_len, ", ", head_dim / 2, "]");
    MINFER_CHECK(input_pos.scalar_type() == at::kLong && input_pos.dim() == 1 && input_pos.size(0) == tokens,
                "minfer.rope_write_kv: input_pos must be int64 [", tokens, "]");
    const auto dtype = q.scalar_type();
    MINFER_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype && k_cache.scalar_type() == dtype &&
                    v_cache.scalar_type() == dtype,
                "minfer.rope_write_kv: q, k, v and the caches must share one dtype");
    const auto device = q.device();
    MINFER_CHECK(k.device() == device && v.device() == device && cos.device() == device && sin.device() == device &&
                    input_pos.device() == device && k_cache.device() == device && v_cache.device() == device,
                "minfer.rope_write_kv: tensors on different devices");
    const c10::cuda::CUDAGuard guard(device);
    minfer::launch_rope_write_kv(q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr<float>(),
                                 sin.data_ptr<float>(), input_pos.data_ptr<int64_t>(), k_cache.data_ptr(),
                                 v_cache.data_ptr(), batch, tokens, q_heads, kv_heads, head_dim, max_seq_len, qs, ks,
                                 vs, dtype_of(q), current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("silu_mul(Tensor gate_up, Tensor(a!) out) -> ()");
    m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
    m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps, Tensor(b!) out) -> ()");
    m.def("rope_write_kv(Tensor(a!) q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor input_pos, Tensor(b!) k_cache, Tensor(c!) v_cache) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("silu_mul", &silu_mul);
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("rope_write_kv", &rope_write_kv);
}
