// The MACKO-16-4 row walker shared by the SpMV/SpMM and decompression kernels (macko_spmv.cu) and the
// tensor-core SpMM (macko_tensor_core_spmm.cu): one warp walks a run of stored entries (a row, or the part
// of a row inside one column window), lane l holding 8 consecutive entries per warp step, with the next
// group of loads in flight while the current one is decoded and handed to a consumer.
#pragma once
#include "common/device_utils.cuh"

namespace minfer {

namespace {

constexpr int kWarpSize = 32;
constexpr int kChunk = 8;                      // entries per lane per load
constexpr int kStep = kWarpSize * kChunk;      // entries per warp step
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxThreads = 512;

__device__ __forceinline__ uint32_t load_stream_4B(const uint32_t* ptr) {
    uint32_t r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(ptr));
    return r;
}

__device__ __forceinline__ uint32_t load_coherent_u16(const uint16_t* ptr) {
    unsigned short r;
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(r) : "l"(ptr) : "memory");
    return r;
}

template <typename T> __device__ __forceinline__ float bits_to_float(uint32_t bits);
template <> __device__ __forceinline__ float bits_to_float<half>(uint32_t bits) {
    return __half2float(__ushort_as_half((unsigned short)bits));
}
template <> __device__ __forceinline__ float bits_to_float<__nv_bfloat16>(uint32_t bits) {
    return __uint_as_float(bits << 16);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Nibble prefix sums of one chunk: entry j sits at column `base + j + prefix(j)`.
struct ChunkNibbles {
    uint32_t even;  // byte k: nibbles 0..2k summed
    uint32_t odd;   // byte k: nibbles 0..2k+1 summed
    __device__ __forceinline__ int prefix(int j) const { return ((j & 1 ? odd : even) >> (8 * (j >> 1))) & 0xff; }
    __device__ __forceinline__ uint32_t total() const { return odd >> 24; }
};

__device__ __forceinline__ ChunkNibbles chunk_nibbles(uint32_t nibbles) {
    const uint32_t lo = nibbles & 0x0f0f0f0fu;          // nibbles 0, 2, 4, 6 (one per byte)
    const uint32_t hi = (nibbles >> 4) & 0x0f0f0f0fu;   // nibbles 1, 3, 5, 7
    const uint32_t odd = (lo + hi) * 0x01010101u;       // bytewise prefix sums, each <= 120: no carries
    return {odd - hi, odd};
}

// Inclusive warp scan; the shuffle's own in-range predicate guards each add (two instructions per
// level instead of four).
template <int OFFSET>
__device__ __forceinline__ void scan_level(uint32_t& v) {
    asm volatile("{\n .reg .pred in_range;\n .reg .u32 up;\n"
                 " shfl.sync.up.b32 up|in_range, %0, %1, 0, -1;\n"
                 " @in_range add.u32 %0, %0, up;\n}"
                 : "+r"(v)
                 : "n"(OFFSET));
}

__device__ __forceinline__ uint32_t warp_inclusive_scan(uint32_t v) {
    scan_level<1>(v);
    scan_level<2>(v);
    scan_level<4>(v);
    scan_level<8>(v);
    scan_level<16>(v);
    return v;
}

template <int STEPS>
struct Group {
    uint4 values[STEPS];
    uint32_t nibbles[STEPS];
};

// Warp-uniform position of one group: run `row` spans entries [s, e); the group starts at entry a.
struct GroupCursor {
    int row, s, e, a;
};

// The groups of rows first, first + stride, ... in order; each row's bounds are read one row ahead.
// PAIRS (a [gate; up] matrix, rows = 2 x half): gate row p, then its up row p + half, then gate row
// p + stride, ..., so one warp holds both halves of each silu(gate) * up output.
template <int STEPS, bool PAIRS = false>
struct RowGroups {
    const int* __restrict__ row_ptr;
    int rows, stride;
    int next_s = 0, next_e = 0;  // the bounds of the row after the current one

    __device__ __forceinline__ int end() const { return rows; }
    // Column of the latest run's entry s, less its nibble and everything after (see walk_groups).
    __device__ __forceinline__ int run_origin() const { return 0; }

    // The row walked after `row`; rows or more when there is none.
    __device__ __forceinline__ int next_row(int row) const {
        if constexpr (!PAIRS) {
            return row + stride;
        } else {
            const int half = rows / 2;
            if (row < half) return row + half;
            const int gate = row - half + stride;
            return gate < half ? gate : rows;
        }
    }

    __device__ __forceinline__ void read_next(int row) {
        if (row < rows) {
            next_s = row_ptr[row];
            next_e = row_ptr[row + 1];
        }
    }

    // With PAIRS, a warp whose first row is past the gate half walks nothing.
    __device__ __forceinline__ GroupCursor first(int row) {
        if (PAIRS && row >= rows / 2) row = rows;
        GroupCursor c{row, 0, 0, 0};
        if (row < rows) {
            c.s = row_ptr[row];
            c.e = row_ptr[row + 1];
            c.a = c.s & ~(kChunk - 1);
        }
        read_next(next_row(row));
        return c;
    }

    __device__ __forceinline__ GroupCursor after(const GroupCursor& c) {
        GroupCursor n{c.row, c.s, c.e, c.a + STEPS * kStep};
        if (n.a >= c.e) {
            n = GroupCursor{next_row(c.row), next_s, next_e, next_s & ~(kChunk - 1)};
            read_next(next_row(n.row));
        }
        return n;
    }
};

// Lanes whose chunk starts at or past the row's end load nothing and keep their old registers:
// the decode never reads those entries.
template <int STEPS>
__device__ __forceinline__ void load_batch(const uint4* __restrict__ values, const uint32_t* __restrict__ deltas,
                                           const GroupCursor& c, int lane, Group<STEPS>& g) {
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const uint32_t chunk = ((uint32_t)c.a >> 3) + k * kWarpSize + lane;
        if ((int)(chunk * kChunk) < c.e) {
            g.values[k] = load_stream_16B(values + chunk);
            g.nibbles[k] = load_stream_4B(deltas + chunk);
        }
    }
}

// Decodes one group of row entries [s, e) and hands every entry to the consumer. `carry` counts the
// nibbles of the row's earlier entries. All lanes of the warp call this together. Lanes whose chunk
// starts at or past e hold stale registers (load_batch): only entries in [s, e) reach the consumer.
template <int STEPS, class Consumer>
__device__ __forceinline__ void decode_group(const Group<STEPS>& g, int a, int s, int e, int& carry, int lane,
                                             Consumer& consumer) {
    static_assert(STEPS == 1 || STEPS == 2, "two steps share one scan (16-bit fields)");
    if (e - a <= kChunk) {  // the row's last entries, all in lane 0's first chunk: no scan needed
        if (lane == 0) {
            const int before_row = s - a;
            const uint32_t bits = before_row > 0 ? g.nibbles[0] & (kFullMask << (4 * before_row)) : g.nibbles[0];
            consumer.template chunk<true>(g.values[0], chunk_nibbles(bits), a - s + carry, a, s, e);
        }
        return;
    }
    ChunkNibbles nib[STEPS];
    uint32_t packed = 0;
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        uint32_t bits = g.nibbles[k];
        if (k == 0) {  // a row's first group starts at s & ~7: only lane 0's first chunk holds earlier entries
            const int before_row = s - (a + lane * kChunk);
            if (before_row > 0) bits &= kFullMask << (4 * before_row);
        }
        nib[k] = chunk_nibbles(bits);
        packed |= nib[k].total() << (16 * k);  // a step's sum is <= 32 * 120 < 2^16
    }
    const uint32_t total = __reduce_add_sync(kFullMask, packed);  // beside the scan, not after it
    const uint32_t exclusive = warp_inclusive_scan(packed) - packed;
#pragma unroll
    for (int k = 0; k < STEPS; ++k) {
        const int c0 = a + k * kStep + lane * kChunk;
        const int base = c0 - s + carry + (int)((exclusive >> (16 * k)) & 0xffffu);
        carry += (int)((total >> (16 * k)) & 0xffffu);
        if (c0 >= s && c0 + kChunk <= e) {
            consumer.template chunk<false>(g.values[k], nib[k], base, c0, s, e);
        } else if (c0 < e) {
            consumer.template chunk<true>(g.values[k], nib[k], base, c0, s, e);
        }
    }
}


// Walks the runs of `groups` (RowGroups, or any type with its first / after / end / run_origin) from
// run `first` on, with one group of loads always in flight: two register batches alternate by name (no
// copies). Entry i of a run [s, e) sits in column run_origin() + (i - s) + the nibbles of entries s..i,
// where run_origin() is read right after the cursor that enters the run was made: 0 for a whole row, the
// columns before it for a run that starts inside a row.
// consumer.stage() runs once after the first loads are issued (all threads of the block).
template <int STEPS, class Groups, class Consumer>
__device__ __forceinline__ void walk_groups(const uint4* __restrict__ values, const uint32_t* __restrict__ deltas,
                                            Groups& groups, int end, int first, int lane,
                                            Consumer& consumer) {
    GroupCursor ca = groups.first(first);
    Group<STEPS> batch_a{}, batch_b{};
    if (ca.row < end) load_batch(values, deltas, ca, lane, batch_a);
    consumer.stage();

    int carry = groups.run_origin();
    const auto decode = [&](const Group<STEPS>& g, const GroupCursor& c, const GroupCursor& next) {
        if (c.a == (c.s & ~(kChunk - 1))) consumer.begin_row(c.row);
        decode_group(g, c.a, c.s, c.e, carry, lane, consumer);
        if (next.row != c.row) {
            consumer.end_row(c.row);
            carry = groups.run_origin();
        }
    };
    while (ca.row < end) {
        const GroupCursor cb = groups.after(ca);
        if (cb.row < end) load_batch(values, deltas, cb, lane, batch_b);
        decode(batch_a, ca, cb);
        if (cb.row >= end) break;
        ca = groups.after(cb);
        if (ca.row < end) load_batch(values, deltas, ca, lane, batch_a);
        decode(batch_b, cb, ca);
    }
}

// Rows first_row, first_row + stride, ... (in gate/up pairs with PAIRS).
template <int STEPS, bool PAIRS = false, class Consumer>
__device__ __forceinline__ void walk_rows(const uint4* __restrict__ values, const uint32_t* __restrict__ deltas,
                                          const int* __restrict__ row_ptr, int rows, int first_row, int stride,
                                          int lane, Consumer& consumer) {
    RowGroups<STEPS, PAIRS> groups{row_ptr, rows, stride};
    walk_groups<STEPS>(values, deltas, groups, rows, first_row, lane, consumer);
}

template <typename T>
__device__ __forceinline__ float value_at(const uint4& v, int j) {
    const float2 f = pair_to_float2<T>(word_of(v, j >> 1));
    return (j & 1) ? f.y : f.x;
}


}  // namespace

}  // namespace minfer
