// One-shot all-reduce of a small tensor over the GPUs of one host, through buffers every rank can
// address (torch's symmetric memory: peer pointers over NVLink / PCIe P2P). Framework-free.
#pragma once
#include "common/launch.h"

namespace minfer {

// Each rank's view of the shared memory. `buffers[r]` is rank r's buffer of two slots of `slot_bytes`
// each, `signals[r]` its signal pad (kAllReduceMaxBlocks * kAllReduceMaxRanks uint32 flags, zeroed
// before the first call), `epochs` this rank's own counters (kAllReduceMaxBlocks uint32, zeroed).
struct PeerBuffers {
    void* const* buffers = nullptr;     // device array of world_size pointers
    uint32_t* const* signals = nullptr;  // device array of world_size pointers
    uint32_t* epochs = nullptr;
    int64_t slot_bytes = 0;
    int rank = 0;
    int world_size = 1;
};

constexpr int kAllReduceMaxBlocks = 16;
constexpr int kAllReduceMaxRanks = 8;
constexpr int kAllReduceThreads = 256;  // a block's share: this many 16-byte vectors
constexpr int64_t kAllReduceMaxBytes = (int64_t)kAllReduceMaxBlocks * kAllReduceThreads * 16;

// dst = the sum over ranks of every rank's `src` (numel elements; 16-byte aligned, numel * element size a
// multiple of 16, at most slot_bytes and kAllReduceMaxBytes), summed in float32 in rank order, so every rank gets the same
// bits. dst may be src. Every rank must call it with the same numel, in the same order of calls.
// Each block copies its chunk of src into the rank's slot (epoch & 1), raises its flag in every peer's
// signal pad, waits for every peer's flag, then reads the peers' slots. A rank reuses a slot only two
// calls later, after every peer has raised the next call's flag, so no peer is still reading it.
void launch_one_shot_all_reduce(const void* src, void* dst, int64_t numel, DType dtype, const PeerBuffers& peers,
                                cudaStream_t stream);

}  // namespace minfer
