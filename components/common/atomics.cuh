// Scoped memory operations on global memory: ld.acquire / ld.relaxed, st.release / st.relaxed, red and atom
// (add), each with a .gpu (this GPU) or .sys (every GPU of the NVLink domain and the host) scope.
// Values are u32 bit patterns: a signed counter adds 0xffffffff for -1 (two's complement addition).
#pragma once

#include "utils.cuh"

namespace megamoe::ptx {

// NOTES: the scope names the set of threads the ordering is promised to. Peers on other GPUs read and write
// through the NVLink mapping, so any release/acquire pair that publishes data to a peer (or observes a peer's)
// must be .sys on both sides; pairs between CTAs of one GPU need only .gpu (DESIGN section 5b).
enum class Scope { kGpu, kSys };

template <Scope kScope>
MEGAMOE_DEVICE uint32_t ld_acquire(const uint32_t* ptr) {
    uint32_t value;
    if constexpr (kScope == Scope::kGpu)
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    else
        asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

template <Scope kScope>
MEGAMOE_DEVICE uint32_t ld_relaxed(const uint32_t* ptr) {
    uint32_t value;
    if constexpr (kScope == Scope::kGpu)
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    else
        asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

template <Scope kScope>
MEGAMOE_DEVICE void st_release(uint32_t* ptr, uint32_t value) {
    if constexpr (kScope == Scope::kGpu)
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
    else
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

template <Scope kScope>
MEGAMOE_DEVICE void st_relaxed(uint32_t* ptr, uint32_t value) {
    if constexpr (kScope == Scope::kGpu)
        asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
    else
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// red: an atomic add without a result (fire and forget).
template <Scope kScope>
MEGAMOE_DEVICE void red_add_release(uint32_t* ptr, uint32_t value) {
    if constexpr (kScope == Scope::kGpu)
        asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
    else
        asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

template <Scope kScope>
MEGAMOE_DEVICE void red_add_relaxed(uint32_t* ptr, uint32_t value) {
    if constexpr (kScope == Scope::kGpu)
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
    else
        asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// PTX text: relaxed gpu-scope increments by one of BASE[lo - 1] and BASE[hi - 1] for the nonzero 16-bit halves of
// the .u32 register W (two 1-based indices, 0 for none; BASE a .u64 operand). The enclosing asm block declares
// `.reg .pred r; .reg .u32 lo, hi; .reg .u64 a;`.
#define MEGAMOE_PTX_RED_INC_PAIR(W, BASE)                         \
    "and.b32 lo, " W ", 65535;\n"                                \
    "shr.u32 hi, " W ", 16;\n"                                   \
    "setp.ne.u32 r, lo, 0;\n"                                    \
    "mad.wide.u32 a, lo, 4, " BASE ";\n"                         \
    "@r red.relaxed.gpu.global.add.u32 [a+-4], 1;\n"             \
    "setp.ne.u32 r, hi, 0;\n"                                    \
    "mad.wide.u32 a, hi, 4, " BASE ";\n"                         \
    "@r red.relaxed.gpu.global.add.u32 [a+-4], 1;\n"

// MEGAMOE_PTX_RED_INC_PAIR for packed = lo | hi << 16. One asm block: written as C++ branches or a loop, the
// second increment made the fused kernel's math warpgroups spill 96-140 B.
MEGAMOE_DEVICE void red_inc_relaxed_gpu_pair(uint32_t* base, uint32_t packed) {
    asm volatile("{\n"
                 ".reg .pred r;\n.reg .u32 lo, hi;\n.reg .u64 a;\n"
                 MEGAMOE_PTX_RED_INC_PAIR("%1", "%0")
                 "}" ::"l"(base), "r"(packed) : "memory");
}

// atom: an atomic add returning the previous value.
template <Scope kScope>
MEGAMOE_DEVICE uint32_t atom_add_release(uint32_t* ptr, uint32_t value) {
    uint32_t old;
    if constexpr (kScope == Scope::kGpu)
        asm volatile("atom.release.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    else
        asm volatile("atom.release.sys.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

// acq_rel: the add both publishes the caller's earlier writes and, when it observes the last of a series of
// such adds, makes every earlier adder's writes visible to the caller (counting completions of shared work).
template <Scope kScope>
MEGAMOE_DEVICE uint32_t atom_add_acq_rel(uint32_t* ptr, uint32_t value) {
    uint32_t old;
    if constexpr (kScope == Scope::kGpu)
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    else
        asm volatile("atom.acq_rel.sys.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

template <Scope kScope>
MEGAMOE_DEVICE uint32_t atom_add_relaxed(uint32_t* ptr, uint32_t value) {
    uint32_t old;
    if constexpr (kScope == Scope::kGpu)
        asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    else
        asm volatile("atom.relaxed.sys.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(value) : "memory");
    return old;
}

// 16 B relaxed load at .gpu scope (data another CTA of this launch wrote and published: never the
// non-coherent __ldg path).
MEGAMOE_DEVICE uint4 ld_relaxed_gpu_v4(const uint4* ptr) {
    uint4 v;
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr)
                 : "memory");
    return v;
}

}  // namespace megamoe::ptx
