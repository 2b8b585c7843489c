// HGEMM dispatch: picks the sm90 (wgmma + TMA) or sm80 (mma.sync) path by device, or the one named.
#include <cstring>

#include "hgemm.h"

namespace minfer {

namespace {

struct KernelChoice {
    const char* name;
    bool sm90;    // false: the sm80 path
    int tile;     // 0: the path chooses; else BM (sm80) or BN (sm90)
    int cluster;  // sm90: CTAs per cluster
};

constexpr KernelChoice kKernels[] = {
    {"sm80", false, 0, 1},           {"sm80_64x128", false, 64, 1},    {"sm80_128x128", false, 128, 1},
    {"sm90", true, 0, 1},            {"sm90_128x64", true, 64, 1},     {"sm90_128x128", true, 128, 1},
    {"sm90_128x192", true, 192, 1},  {"sm90_128x256", true, 256, 1},   {"sm90_128x128_c2", true, 128, 2},
    {"sm90_128x192_c2", true, 192, 2}, {"sm90_128x256_c2", true, 256, 2},
};

}  // namespace

const char* launch_hgemm(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k, DType dtype,
                         const char* kernel, cudaStream_t stream) {
    if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) return "HGEMM takes float16 or bfloat16";
    if (n % 8 != 0 || k % 8 != 0) return "N and K must be multiples of 8 (16-byte rows)";
    if (m >= (1ll << 31) || n >= (1ll << 31) || k >= (1ll << 31)) return "M, N and K must each be below 2^31";
    if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) | reinterpret_cast<uintptr_t>(y)) % 16 != 0)
        return "x, w and out must start on 16-byte boundaries";
    if (m == 0 || n == 0) return nullptr;
    if (k == 0) return "K must be positive";

    bool sm90 = false;
    int tile = 0, cluster = 1;
    if (std::strcmp(kernel, "auto") == 0) {
        sm90 = hgemm_sm90_available();
    } else {
        const KernelChoice* choice = nullptr;
        for (const KernelChoice& c : kKernels)
            if (std::strcmp(kernel, c.name) == 0) choice = &c;
        if (choice == nullptr)
            return "unknown kernel; use auto, sm80, sm80_64x128, sm80_128x128, sm90, sm90_128x64, sm90_128x128, "
                   "sm90_128x192, sm90_128x256, sm90_128x128_c2, sm90_128x192_c2 or sm90_128x256_c2";
        sm90 = choice->sm90;
        tile = choice->tile;
        cluster = choice->cluster;
    }
    const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
    return sm90 ? launch_hgemm_sm90(x, w, y, mi, ni, ki, dtype, tile, cluster, stream)
                : launch_hgemm_sm80(x, w, y, mi, ni, ki, dtype, tile, stream);
}

}  // namespace minfer
