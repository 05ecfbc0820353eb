// How fast one SM's bulk-copy weight feed runs when few SMs stream (the decode tail of the fused kernel: the last
// CTAs finish their last L2 tile while the others are idle; notes/fused.md). G CTAs (one per SM) each stream
// kPerCtaBytes of distinct, DRAM-cold weights into a ring of `stages` x 16 KB shared-memory stages with non-tensor
// cp.async.bulk (the fused kernel's B feed: gemm/producer.cuh), a releasing consumer and nothing else. Each CTA
// times itself with %globaltimer; reported: the median over launches of the mean per-CTA rate, and the aggregate.
// A standalone program (no torch); on the GPU machine:
//   nvcc -arch=sm_90a -O3 -o /tmp/probe_sm_feed scripts/probe_sm_feed.cu && /tmp/probe_sm_feed
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>

#define CK(x) do { auto e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

constexpr uint64_t kBytes = 32ull * 3 * 4096 * 2048;  // flash: 32 experts x 3 x H x I = 805 MB
constexpr uint32_t kChunk = 16384;                     // one B stage
constexpr uint64_t kPerCtaBytes = 1u << 20;           // 1 MB per CTA: four L2 tiles of the decode load

#include "probe_mbarrier.cuh"

__device__ __forceinline__ uint64_t now_ns() { uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }

// CTA b streams [base + b * kPerCtaBytes, + kPerCtaBytes) (mod kBytes); times[b] = its elapsed ns
__global__ void __launch_bounds__(64, 1) feed(const uint8_t* w, uint64_t base, uint32_t stages, uint64_t* times) {
    extern __shared__ __align__(1024) uint8_t smem[];
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * kChunk);
    uint64_t* empty = full + stages;
    if (threadIdx.x == 0)
        init_ring_barriers(full, stages);
    __syncthreads();
    const uint64_t start = now_ns();
    const uint64_t first = (base + blockIdx.x * kPerCtaBytes) % kBytes;
    constexpr uint32_t kNumChunks = kPerCtaBytes / kChunk;
    if (threadIdx.x == 0) {
        uint32_t stage = 0, phase = 0;
        for (uint32_t c = 0; c < kNumChunks; ++ c) {
            bar_wait(empty + stage, phase ^ 1);
            bar_expect(full + stage, kChunk);
            bulk_load(smem + stage * kChunk, w + (first + static_cast<uint64_t>(c) * kChunk) % kBytes, kChunk,
                      full + stage);
            ring_advance(stage, phase, stages);
        }
    } else if (threadIdx.x == 32) {
        uint32_t stage = 0, phase = 0;
        for (uint32_t c = 0; c < kNumChunks; ++ c) {
            bar_wait(full + stage, phase);
            bar_arrive(empty + stage);
            ring_advance(stage, phase, stages);
        }
        times[blockIdx.x] = now_ns() - start;
    }
}

int main() {
    uint8_t* w; uint64_t* times;
    CK(cudaMalloc(&w, kBytes)); CK(cudaMalloc(&times, 132 * sizeof(uint64_t)));
    CK(cudaMemset(w, 0x5a, kBytes));
    CK(cudaFuncSetAttribute(feed, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    const uint32_t grids[] = {1, 2, 4, 8, 16, 33, 66, 99, 132};
    const uint32_t stage_counts[] = {4, 8, 12};
    printf("per-CTA feed, %llu KB per CTA from DRAM-cold weights, 16 KB bulk copies (medians of 40 launches)\n",
           static_cast<unsigned long long>(kPerCtaBytes >> 10));
    printf("%7s %6s %14s %14s %14s\n", "stages", "CTAs", "per-CTA GB/s", "slowest GB/s", "aggregate TB/s");
    uint64_t base = 0;
    for (uint32_t stages : stage_counts)
        for (uint32_t grid : grids) {
            std::vector<double> mean_rate, min_rate, aggregate;
            for (int it = 0; it < 45; ++ it) {
                feed<<<grid, 64, stages * kChunk + 2 * stages * 8>>>(w, base, stages, times);
                base = (base + grid * kPerCtaBytes) % kBytes;  // fresh bytes each launch (the buffer is 16x L2)
                CK(cudaDeviceSynchronize());
                if (it < 5)
                    continue;
                uint64_t h[132];
                CK(cudaMemcpy(h, times, grid * sizeof(uint64_t), cudaMemcpyDeviceToHost));
                double sum = 0, worst = 0;
                for (uint32_t b = 0; b < grid; ++ b) { sum += kPerCtaBytes / double(h[b]); worst = std::max(worst, double(h[b])); }
                mean_rate.push_back(sum / grid);
                min_rate.push_back(kPerCtaBytes / worst);
                aggregate.push_back(grid * kPerCtaBytes / worst / 1e3);
            }
            auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
            printf("%7u %6u %14.1f %14.1f %14.2f\n", stages, grid, med(mean_rate), med(min_rate), med(aggregate));
        }
    return 0;
}
