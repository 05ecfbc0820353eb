// The weight feed alone: how fast 132 CTAs stream 805 MB (the flash shape's weights) into shared memory, by copy
// kind (notes/gemm.md, "Weights in the tile layout"). tma2d: the 2D tensor boxes of the row-major weights (128 rows x
// 128 B, 128 B swizzle, a tile's 32 K blocks in order); bulk1d: the same bytes tile-contiguous, non-tensor
// cp.async.bulk of the stage size; ldg: plain 16 B loads (the read floor). One producer thread and one releasing
// consumer per CTA, nothing else. A standalone program (no torch); on the GPU machine:
//   nvcc -arch=sm_90a -O3 -o /tmp/probe_weight_feed scripts/probe_weight_feed.cu && /tmp/probe_weight_feed
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>

#define CK(x) do { auto e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr uint64_t kBytes = 32ull * 3 * 4096 * 2048;  // flash: 32 experts x 3 x H x I
constexpr uint32_t kK = 4096;                          // row length in bytes (K of the L1 weights)
constexpr uint32_t kTileBytes = 128 * kK;              // one n-block of 128 rows: 512 KB
constexpr uint32_t kNumTiles = kBytes / kTileBytes;    // 1536

#include "probe_mbarrier.cuh"

template <int kMode, int kStages, int kChunk>
__global__ void __launch_bounds__(128, 1) feed(const __grid_constant__ CUtensorMap map, const uint8_t* w) {
    extern __shared__ __align__(1024) uint8_t smem[];
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kChunk);
    uint64_t* empty = full + kStages;
    if (threadIdx.x == 0)
        init_ring_barriers(full, kStages);
    __syncthreads();
    constexpr uint32_t kChunksPerTile = kTileBytes / kChunk;
    if (threadIdx.x == 0) {
        uint32_t stage = 0, phase = 0;
        for (uint32_t t = blockIdx.x; t < kNumTiles; t += gridDim.x) {
            for (uint32_t c = 0; c < kChunksPerTile; ++ c) {
                bar_wait(empty + stage, phase ^ 1);
                bar_expect(full + stage, kChunk);
                uint8_t* dst = smem + stage * kChunk;
                if constexpr (kMode == 0) {
                    // 2D boxes: (kChunk / 16 KB) boxes of 128 rows x 128 B, at column c * (kChunk / 128 rows)
                    for (uint32_t j = 0; j < kChunk / 16384; ++ j)
                        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                                     " [%0], [%1, {%3, %4}], [%2];"
                                     ::"r"(sa(dst + j * 16384)), "l"(reinterpret_cast<uint64_t>(&map)),
                                       "r"(sa(full + stage)), "r"((c * (kChunk / 16384) + j) * 128), "r"(t * 128)
                                     : "memory");
                } else {
                    bulk_load(dst, w + static_cast<uint64_t>(t) * kTileBytes + static_cast<uint64_t>(c) * kChunk, kChunk,
                              full + stage);
                }
                ring_advance(stage, phase, kStages);
            }
        }
    } else if (threadIdx.x == 32) {
        uint32_t stage = 0, phase = 0;
        for (uint32_t t = blockIdx.x; t < kNumTiles; t += gridDim.x)
            for (uint32_t c = 0; c < kChunksPerTile; ++ c) {
                bar_wait(full + stage, phase);
                bar_arrive(empty + stage);
                ring_advance(stage, phase, kStages);
            }
    }
}

__global__ void ldg(const uint4* w, uint64_t n, uint32_t* sink) {
    uint32_t acc = 0;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x;
    for (; i + 7 * stride < n; i += 8 * stride) {
        uint4 v[8];
        #pragma unroll
        for (int j = 0; j < 8; ++ j) v[j] = __ldcs(w + i + j * stride);
        #pragma unroll
        for (int j = 0; j < 8; ++ j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n; i += stride) { uint4 v = w[i]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (acc == 0x12345678u) *sink = acc;
}

__global__ void fill(uint32_t* w, uint64_t n) {
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        uint32_t x = static_cast<uint32_t>(i) * 2654435761u;
        w[i] = x ^ (x >> 15);
    }
}

struct Variant { const char* name; void (*launch)(const CUtensorMap&, const uint8_t*, uint32_t*); };

template <int kMode, int kStages, int kChunk>
void launch_feed(const CUtensorMap& map, const uint8_t* w, uint32_t*) {
    constexpr int smem = kStages * kChunk + 2 * kStages * 8;
    static bool set = false;
    if (!set) { CK(cudaFuncSetAttribute(feed<kMode, kStages, kChunk>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)); set = true; }
    feed<kMode, kStages, kChunk><<<132, 128, smem>>>(map, w);
}
void launch_ldg(const CUtensorMap&, const uint8_t* w, uint32_t* sink) {
    ldg<<<132 * 4, 512>>>(reinterpret_cast<const uint4*>(w), kBytes / 16, sink);
}

int main() {
    uint8_t* w; uint32_t* sink;
    CK(cudaMalloc(&w, kBytes)); CK(cudaMalloc(&sink, 4));
    fill<<<1024, 256>>>(reinterpret_cast<uint32_t*>(w), kBytes / 4);
    CK(cudaDeviceSynchronize());
    CUtensorMap map;
    cuuint64_t dims[2] = {kK, kBytes / kK};
    cuuint64_t strides[1] = {kK};
    cuuint32_t box[2] = {128, 128}, elem[2] = {1, 1};
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    void* fn = nullptr; cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q));
    CUresult r = reinterpret_cast<Encode>(fn)(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, strides, box, elem,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { printf("tensor map: %d\n", r); return 1; }
    std::vector<Variant> vs = {
        {"ldg 16B (floor)", launch_ldg},
        {"tma2d 16KB x 5 stages", launch_feed<0, 5, 16384>},
        {"tma2d 16KB x 8 stages", launch_feed<0, 8, 16384>},
        {"tma2d 32KB (2 boxes) x 4", launch_feed<0, 4, 32768>},
        {"bulk1d 16KB x 5 stages", launch_feed<1, 5, 16384>},
        {"bulk1d 16KB x 8 stages", launch_feed<1, 8, 16384>},
        {"bulk1d 32KB x 4 stages", launch_feed<1, 4, 32768>},
        {"bulk1d 64KB x 2 stages", launch_feed<1, 2, 65536>},
        {"bulk1d 8KB x 16 stages", launch_feed<1, 16, 8192>},
    };
    std::vector<std::vector<float>> times(vs.size());
    cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int round = 0; round < 4; ++ round)
        for (size_t v = 0; v < vs.size(); ++ v) {
            for (int i = 0; i < 3; ++ i) vs[v].launch(map, w, sink);
            for (int i = 0; i < 15; ++ i) {
                CK(cudaEventRecord(a)); vs[v].launch(map, w, sink); CK(cudaEventRecord(b)); CK(cudaEventSynchronize(b));
                float ms; CK(cudaEventElapsedTime(&ms, a, b)); times[v].push_back(ms * 1e3f);
            }
            CK(cudaGetLastError());
        }
    for (size_t v = 0; v < vs.size(); ++ v) {
        std::sort(times[v].begin(), times[v].end());
        float med = times[v][times[v].size() / 2];
        printf("%-28s median %7.1f us = %.2f TB/s (min %.1f)\n", vs[v].name, med, kBytes / med / 1e6, times[v][0]);
    }
    return 0;
}
