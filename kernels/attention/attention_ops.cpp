// Attention over the static KV cache: split-K flash-decoding (decode_attention.h).
// Each binding checks the tensors and forwards raw pointers to the framework-free launchers.
#include "common/torch_binding.h"
#include "attention/decode_attention.h"

namespace {

using namespace minfer::binding;

// Checks the tensors and launches; `kept` (null: dense) is the block-sparse layout's decode form.
void launch_checked(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& input_pos, double scale, at::Tensor& out, at::Tensor& workspace,
                    int64_t num_splits, int64_t stages, const minfer::DecodeKeptTiles* kept) {
    MINFER_CHECK(q.is_cuda() && q.dim() == 3 && q.stride(2) == 1,
                "minfer.decode_attention: q must be a CUDA [B, Hq, D] tensor with a contiguous last dim");
    check_cuda_contiguous(k_cache, "k_cache");
    check_cuda_contiguous(v_cache, "v_cache");
    check_cuda_contiguous(input_pos, "input_pos");
    check_cuda_contiguous(out, "out");
    check_cuda_contiguous(workspace, "workspace");
    const int64_t batch = q.size(0), q_heads = q.size(1), head_dim = q.size(2);
    MINFER_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == batch &&
                    k_cache.size(3) == head_dim,
                "minfer.decode_attention: caches must be [", batch, ", Hkv, S, ", head_dim, "]");
    const int64_t kv_heads = k_cache.size(1), max_seq_len = k_cache.size(2);
    MINFER_CHECK(head_dim == 64 || head_dim == 128, "minfer.decode_attention: head_dim 64 or 128, got ", head_dim);
    MINFER_CHECK(kv_heads >= 1 && q_heads % kv_heads == 0 && q_heads / kv_heads <= minfer::kDecodeAttnMaxGroup,
                "minfer.decode_attention: Hq must be a multiple of Hkv, at most ", minfer::kDecodeAttnMaxGroup,
                " times it; got Hq=", q_heads, ", Hkv=", kv_heads);
    MINFER_CHECK(max_seq_len >= 1, "minfer.decode_attention: empty cache");
    const auto dtype = q.scalar_type();
    MINFER_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
                "minfer.decode_attention: float16 or bfloat16 only, got ", dtype);
    MINFER_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
                "minfer.decode_attention: q, caches and out must share one dtype");
    MINFER_CHECK(reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % 16 == 0,
                "minfer.decode_attention: caches must be 16-byte aligned");
    MINFER_CHECK(input_pos.scalar_type() == at::kLong && input_pos.numel() == 1,
                "minfer.decode_attention: input_pos must be int64 with one element");
    MINFER_CHECK(out.sizes() == q.sizes(), "minfer.decode_attention: out must be [", batch, ", ", q_heads, ", ",
                head_dim, "]");
    MINFER_CHECK(num_splits >= 1 && num_splits <= minfer::kDecodeAttnMaxSplits,
                "minfer.decode_attention: num_splits must be in 1..", minfer::kDecodeAttnMaxSplits);
    const int64_t need = minfer::decode_attention_workspace_floats(batch, q_heads, kv_heads, head_dim, num_splits);
    MINFER_CHECK(workspace.scalar_type() == at::kFloat && workspace.numel() >= need &&
                    reinterpret_cast<uintptr_t>(workspace.data_ptr()) % 16 == 0,
                "minfer.decode_attention: workspace must be zero-initialised float32 of >= ", need,
                " elements (minfer.ops.decode_attention_workspace makes one)");
    const auto device = q.device();
    MINFER_CHECK(k_cache.device() == device && v_cache.device() == device && input_pos.device() == device &&
                    out.device() == device && workspace.device() == device,
                "minfer.decode_attention: tensors on different devices");
    const c10::cuda::CUDAGuard guard(device);
    minfer::launch_decode_attention(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                                    input_pos.data_ptr<int64_t>(), (float)scale, out.data_ptr(),
                                    workspace.data_ptr<float>(), batch, q_heads, kv_heads, head_dim, max_seq_len,
                                    (int)num_splits, (int)stages, dtype_of(q), current_stream(), kept);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The shared-memory ring depth pinned (`stages`, decode_attention.h), for tests of every depth.
void decode_attention_tuned(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& input_pos, double scale, at::Tensor& out, at::Tensor& workspace,
                            int64_t num_splits, int64_t stages) {
    launch_checked(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, stages, nullptr);
}

// The key tiles' values are not checked here (that would read them back): a tile past the query's is
// masked by position, and DecodeLayout builds only ascending tiles up to the query's.
void decode_attention_blocksparse(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& input_pos, double scale, at::Tensor& out, at::Tensor& workspace,
                                  int64_t num_splits, const at::Tensor& tile_ptr, const at::Tensor& key_tiles,
                                  const at::Tensor& head_bits, int64_t layout_groups, int64_t stages) {
    for (const auto* t : {&tile_ptr, &key_tiles, &head_bits}) {
        check_cuda_contiguous(*t, "the decode layout's arrays");
        MINFER_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->device() == q.device(),
                    "minfer.decode_attention_blocksparse: tile_ptr, key_tiles and head_bits must be 1-d int32 on "
                    "q's device");
    }
    MINFER_CHECK(k_cache.dim() == 4, "minfer.decode_attention_blocksparse: caches must be [B, Hkv, S, D]");
    const int64_t q_tiles = (k_cache.size(2) + minfer::kDecodeAttnKeyTile - 1) / minfer::kDecodeAttnKeyTile;
    MINFER_CHECK(layout_groups == 1 || layout_groups == k_cache.size(1),
                "minfer.decode_attention_blocksparse: layout_groups must be 1 or Hkv=", k_cache.size(1), ", got ",
                layout_groups);
    MINFER_CHECK(tile_ptr.numel() == layout_groups * q_tiles + 1 && key_tiles.numel() == head_bits.numel(),
                "minfer.decode_attention_blocksparse: ", layout_groups, " groups over ", q_tiles,
                " query tiles need tile_ptr of ", layout_groups * q_tiles + 1,
                " entries and key_tiles, head_bits of one length (build the layout for the cache's length)");
    const minfer::DecodeKeptTiles kept{tile_ptr.data_ptr<int32_t>(), key_tiles.data_ptr<int32_t>(),
                                       head_bits.data_ptr<int32_t>(), (int)layout_groups, (int)q_tiles, 0, 0, 0};
    launch_checked(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, stages, &kept);
}

// The sink-window layout (sizes in tokens, layout blocks of block_size), its tiles found from the position.
void decode_attention_sink_window(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& input_pos, double scale, at::Tensor& out, at::Tensor& workspace,
                                  int64_t num_splits, int64_t sink, int64_t window, int64_t block_size,
                                  int64_t stages) {
    constexpr int64_t tile = minfer::kDecodeAttnKeyTile;
    MINFER_CHECK(block_size >= tile && block_size % tile == 0 && block_size <= (1 << 20),
                "minfer.decode_attention_sink_window: block_size must be a multiple of ", tile, ", got ", block_size);
    MINFER_CHECK(sink >= 0 && sink <= (1 << 30) && window >= 1 && window <= (1 << 30),
                "minfer.decode_attention_sink_window: sink >= 0 and window >= 1 tokens, got sink=", sink,
                ", window=", window);
    const int64_t block_tiles = block_size / tile;
    const minfer::DecodeKeptTiles kept{nullptr, nullptr, nullptr, 1, 0,
                                       (int)((sink + block_size - 1) / block_size * block_tiles), (int)window,
                                       (int)block_tiles};
    launch_checked(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, stages, &kept);
}

void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& input_pos, double scale, at::Tensor& out, at::Tensor& workspace,
                      int64_t num_splits) {
    decode_attention_tuned(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, 0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, float scale, Tensor(a!) out, "
          "Tensor(b!) workspace, int num_splits) -> ()");
    m.def("decode_attention_tuned(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, float scale, "
          "Tensor(a!) out, Tensor(b!) workspace, int num_splits, int stages) -> ()");
    m.def("decode_attention_blocksparse(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, float scale, "
          "Tensor(a!) out, Tensor(b!) workspace, int num_splits, Tensor tile_ptr, Tensor key_tiles, Tensor head_bits, "
          "int layout_groups, int stages) -> ()");
    m.def("decode_attention_sink_window(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos, float scale, "
          "Tensor(a!) out, Tensor(b!) workspace, int num_splits, int sink, int window, int block_size, "
          "int stages) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("decode_attention", &decode_attention);
    m.impl("decode_attention_tuned", &decode_attention_tuned);
    m.impl("decode_attention_blocksparse", &decode_attention_blocksparse);
    m.impl("decode_attention_sink_window", &decode_attention_sink_window);
}
