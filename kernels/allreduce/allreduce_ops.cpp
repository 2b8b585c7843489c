// The one-shot all-reduce (one_shot_all_reduce.h): checks the tensors, forwards raw pointers.
#include "allreduce/one_shot_all_reduce.h"
#include "common/torch_binding.h"

namespace {

using namespace minfer::binding;

void one_shot_all_reduce(const at::Tensor& src, at::Tensor& dst, const at::Tensor& buffers, const at::Tensor& signals,
                         at::Tensor& epochs, int64_t slot_bytes, int64_t rank) {
    check_cuda_contiguous(src, "src");
    check_cuda_contiguous(dst, "dst");
    check_cuda_contiguous(buffers, "buffers");
    check_cuda_contiguous(signals, "signals");
    check_cuda_contiguous(epochs, "epochs");
    const int64_t world = buffers.numel();
    MINFER_CHECK(src.scalar_type() == dst.scalar_type() && src.numel() == dst.numel() && src.device() == dst.device(),
                 "minfer.one_shot_all_reduce: src and dst must match in dtype, size and device");
    MINFER_CHECK(buffers.scalar_type() == at::kLong && signals.scalar_type() == at::kLong && signals.numel() == world &&
                     world >= 1 && world <= minfer::kAllReduceMaxRanks,
                 "minfer.one_shot_all_reduce: buffers and signals must be int64 [world] pointer tables, world 1..",
                 minfer::kAllReduceMaxRanks);
    MINFER_CHECK(epochs.scalar_type() == at::kInt && epochs.numel() == minfer::kAllReduceMaxBlocks,
                 "minfer.one_shot_all_reduce: epochs must be int32 [", minfer::kAllReduceMaxBlocks, "]");
    MINFER_CHECK(rank >= 0 && rank < world, "minfer.one_shot_all_reduce: rank out of range");
    const int64_t bytes = src.numel() * (int64_t)src.element_size();
    MINFER_CHECK(bytes % 16 == 0 && bytes <= slot_bytes && slot_bytes % 16 == 0,
                 "minfer.one_shot_all_reduce: the tensor's bytes must be a multiple of 16 and fit a slot (", slot_bytes,
                 " bytes)");
    MINFER_CHECK(bytes <= minfer::kAllReduceMaxBytes, "minfer.one_shot_all_reduce: at most ",
                 minfer::kAllReduceMaxBytes, " bytes");
    MINFER_CHECK(reinterpret_cast<uintptr_t>(src.data_ptr()) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(dst.data_ptr()) % 16 == 0,
                 "minfer.one_shot_all_reduce: src and dst must be 16-byte aligned");
    minfer::PeerBuffers peers;
    peers.buffers = reinterpret_cast<void* const*>(buffers.data_ptr<int64_t>());
    peers.signals = reinterpret_cast<uint32_t* const*>(signals.data_ptr<int64_t>());
    peers.epochs = reinterpret_cast<uint32_t*>(epochs.data_ptr<int32_t>());
    peers.slot_bytes = slot_bytes;
    peers.rank = (int)rank;
    peers.world_size = (int)world;
    const c10::cuda::CUDAGuard guard(src.device());
    minfer::launch_one_shot_all_reduce(src.data_ptr(), dst.data_ptr(), src.numel(), dtype_of(src), peers,
                                       current_stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minfer, m) {
    m.def("one_shot_all_reduce(Tensor src, Tensor(a!) dst, Tensor buffers, Tensor signals, Tensor(b!) epochs, "
          "int slot_bytes, int rank) -> ()");
}

TORCH_LIBRARY_IMPL(minfer, CUDA, m) {
    m.impl("one_shot_all_reduce", &one_shot_all_reduce);
}
